"""Recompute through saved-tensor hooks: the forward keeps placeholders, the backward re-runs the layer.

Every op of a recomputed layer hands the tensor it wants to keep to a pack hook, which returns a
small ``_Slot`` instead; the tensor itself is dropped, so the forward keeps only the layer's inputs
(held by its ``Checkpoint``). The first time the backward unpacks one of its slots, the checkpoint
re-runs the layer on those inputs with recording on, catching what each op saves, in order, and
hands the backward the tensor for that slot. This is the torch ``checkpoint(use_reentrant=False)``
design, and MindSpore's own ``recompute(use_reentrant=False)``, but ours owns the re-run: it can run
two layers' recomputes interleaved (the paired overlap), and stop as soon as every slot is filled.

A layer runs as a *program*: a generator that yields an ``AllReduce`` wherever it needs a collective
and receives the reduced tensor back. The forward drives it synchronously; the recompute drives it
step by step in the order of a ``RecomputeGroup`` (``ms_recompute.pairing``), so the collective of one
layer is in flight while the other layer computes. A Cell without ``program`` is one segment.

Because the outer autograd drives the backward, a split backward (``ms.grad`` for the inputs, then
again for the weights, as ms-pipeline's ZeroBubble runtime does) just works: each pass re-runs the
forward, which makes fresh checkpoints.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any, Callable

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from ..errors import RecomputeError
from ..pairing import Op, RecomputeGroup, pair_layers
from ._tape import recording

Program = Generator["AllReduce", Tensor, Any]


class AllReduce:
    """A collective that a layer program asks for: the sum of ``tensor`` over a process group.

    Megatron's g operator: all-reduce in the forward, identity in the backward. The driver decides
    when it starts (``start``, asynchronous) and when to wait, so other work can run meanwhile."""

    def __init__(self, tensor: Tensor, group: Any):
        self.tensor = tensor
        self.group = group
        self._buf: np.ndarray | None = None
        self._work: Any = None

    def start(self) -> None:
        # A copy: the collective writes in place, and asnumpy() shares the tensor's memory, which the
        # backward may still read. asnumpy() also waits for the kernel that produces the tensor.
        self._buf = np.array(self.tensor.asnumpy(), copy=True, order="C")
        self._work = self.group.all_reduce(self._buf, async_op=True)

    def wait(self) -> None:
        if self._work is None:
            raise RecomputeError("an AllReduce was waited for before it was started")
        self._work.wait()

    def result(self) -> Tensor:
        """The reduced tensor, bit-exact, whose gradient flows to ``tensor`` unchanged: the straight-
        through form keeps nothing for the backward (a custom-bprop Cell would keep both tensors)."""
        reduced = Tensor.from_numpy(self._buf)
        return ops.stop_gradient(reduced) + (self.tensor - ops.stop_gradient(self.tensor))


def run_sync(program: Program) -> Any:
    """Drive a layer program to its end, each collective started and awaited in turn."""
    try:
        request = next(program)
        while True:
            request.start()
            request.wait()
            request = program.send(request.result())
    except StopIteration as done:
        return done.value


def _one_segment(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Program:
    return fn(*args, **kwargs)
    yield  # a generator without any collective


@dataclass(frozen=True)
class TraceEvent:
    """One measured step of a recompute (seconds, ``time.perf_counter``)."""

    layer: int
    """Layer the step belongs to."""
    op: str
    """``compute``, ``issue``, ``wait``, or ``recompute`` (a whole group)."""
    index: int
    """Segment or collective number (for ``recompute``: the group's first layer)."""
    start: float
    """Start time."""
    end: float
    """End time."""


class _Slot:
    """What the tape keeps instead of a tensor."""

    __slots__ = ("checkpoint", "index")

    def __init__(self, checkpoint: Checkpoint, index: int):
        self.checkpoint, self.index = checkpoint, index


def _storage(t: Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


class Checkpoint:
    """One call of a recomputed layer (or sub-module, or function): its inputs and its slots."""

    def __init__(self, runner: Runner, target: Any, args: tuple, kwargs: dict, layer: int, name: str):
        self.runner, self.target, self.args, self.kwargs = runner, target, args, kwargs
        self.layer, self.name = layer, name
        self.count = 0  # tensors the forward saved
        self.captured = 0  # tensors the recompute saved so far
        self.values: dict[int, Tensor] | None = None
        self.partner: Checkpoint | None = None  # the earlier layer of its pair, recomputed together

    # ------------------------------------------------------------ forward side
    def pack(self, t: Tensor) -> _Slot:
        if self.count == 0:
            self.runner.hold_inputs(self)
        slot = _Slot(self, self.count)
        self.count += 1
        return slot

    # ------------------------------------------------------------ backward side
    def unpack(self, slot: _Slot) -> Tensor:
        if self.values is None:
            self.runner.recompute(self)
        try:
            value = self.values.pop(slot.index)
        except KeyError:
            raise RecomputeError(
                f"{self.name}: saved tensor {slot.index} was already read; a recompute slot is read once"
            ) from None
        self.runner.release(value)
        return value

    @property
    def complete(self) -> bool:
        return self.values is not None and self.captured == self.count

    def program(self) -> Program:
        fn = getattr(self.target, "program", None)
        if fn is not None:
            return fn(*self.args, **self.kwargs)
        # a Cell's construct, not its __call__: the call would run our own hooks again
        body = self.target.construct if isinstance(self.target, ms.nn.Cell) else self.target
        return _one_segment(body, self.args, self.kwargs)

    def _capture(self, t: Tensor) -> Tensor:
        if self.captured >= self.count:
            raise RecomputeError(
                f"{self.name}: the recompute saves more tensors than the forward did ({self.count});"
                " the layer must run the same ops both times (no data-dependent control flow or randomness)"
            )
        value = ops.stop_gradient(t)
        self.values[self.captured] = value
        self.captured += 1
        self.runner.retain(value)
        return t

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        if self.values is None:
            self.values = {}
        with ms.saved_tensors_hooks(self._capture, _identity):
            yield


def _identity(x: Any) -> Any:
    return x


class _Run:
    """A checkpoint's program in progress inside a group."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.program: Program | None = None
        self.request: AllReduce | None = None
        self.finished = False

    def compute(self) -> None:
        with self.checkpoint.capturing():
            try:
                if self.program is None:
                    self.program = self.checkpoint.program()
                    self.request = next(self.program)
                else:
                    self.request = self.program.send(self.request.result())
            except StopIteration:
                self.finished, self.request = True, None
        if not self.finished and self.checkpoint.complete:
            # every slot is filled: what follows (the last collective and the residual add) is not needed
            self.program.close()
            self.finished, self.request = True, None


class Runner:
    """Runs the recomputes of the checkpoints it made, and accounts their memory and time."""

    def __init__(self, groups: dict[int, RecomputeGroup] | None = None, comms: int = 0, trace: bool = False):
        self.groups = groups or {}  # layer -> its group (full recompute); others run alone
        self.comms = comms  # collectives per layer recompute that the orders plan for
        self.trace = trace
        self.events: list[TraceEvent] = []
        self.meters: list[Any] = []
        self.recompute_s = 0.0
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self._live: dict[int, list[int]] = {}  # storage -> [bytes, references]

    # ------------------------------------------------------------ memory accounting
    def hold_inputs(self, checkpoint: Checkpoint) -> None:
        for meter in self.meters:
            meter.hold([a for a in (*checkpoint.args, *checkpoint.kwargs.values()) if isinstance(a, Tensor)])

    def retain(self, t: Tensor) -> None:
        key, size = _storage(t)
        entry = self._live.setdefault(key, [size, 0])
        if entry[1] == 0:
            self.live_bytes += size
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        entry[1] += 1

    def release(self, t: Tensor) -> None:
        key, _ = _storage(t)
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live_bytes -= entry[0]
            del self._live[key]

    def reset_stats(self) -> None:
        self.events.clear()
        self.recompute_s, self.peak_live_bytes = 0.0, self.live_bytes

    # ------------------------------------------------------------ recompute
    def recompute(self, checkpoint: Checkpoint) -> None:
        """Recompute ``checkpoint`` -- together with its pair partner if the plan pairs them and the
        partner has not been recomputed yet -- in the order of their group."""
        group = self.groups.get(checkpoint.layer)
        partner = checkpoint.partner
        # the partner must still wait for its recompute, and be from a forward that recorded (a forward
        # without gradients -- ms-pipeline's F pass -- opens checkpoints that never pack anything)
        if group is not None and group.paired and partner is not None and partner.values is None and partner.count:
            runs = {partner.layer: _Run(partner), checkpoint.layer: _Run(checkpoint)}
            order = group.order
        else:  # alone: its segments one after another, each collective awaited before the next
            runs = {checkpoint.layer: _Run(checkpoint)}
            order = pair_layers([checkpoint.layer], self.comms, overlap=False)[0].order
        start = time.perf_counter()
        with recording():
            for step in order:
                run = runs.get(step.layer)
                if run is not None and not run.finished:
                    self._step(run, step.op, step.index)
            for run in runs.values():  # a program with more collectives than the plan says
                k = self.comms
                while not run.finished:
                    self._step(run, Op.ISSUE, k)
                    self._step(run, Op.WAIT, k)
                    k += 1
                    self._step(run, Op.COMPUTE, k)
        end = time.perf_counter()
        self.recompute_s += end - start
        if self.trace:
            self.events.append(TraceEvent(min(runs), "recompute", len(runs), start, end))
        for run in runs.values():
            ck = run.checkpoint
            if not ck.complete:
                raise RecomputeError(f"{ck.name}: the recompute saved {ck.captured} tensors, the forward {ck.count}")

    def _step(self, run: _Run, op: Op, index: int) -> None:
        t0 = time.perf_counter()
        if op is Op.COMPUTE:
            run.compute()
        elif run.request is None:
            return
        elif op is Op.ISSUE:
            run.request.start()
        else:
            run.request.wait()
        if self.trace:
            self.events.append(TraceEvent(run.checkpoint.layer, op.name.lower(), index, t0, time.perf_counter()))


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping only its inputs for the backward; whatever its ops save
    is recomputed when the backward needs it. ``fn`` may use Parameters (closures, Cells); their
    gradients come out of the ordinary backward."""
    from ._tape import grad_enabled

    if not grad_enabled():
        return fn(*args, **kwargs)
    ck = Checkpoint(_STANDALONE, fn, args, kwargs, -1, getattr(fn, "__name__", "function"))
    with ms.saved_tensors_hooks(ck.pack, ck.unpack):
        return fn(*args, **kwargs)


_STANDALONE = Runner()
