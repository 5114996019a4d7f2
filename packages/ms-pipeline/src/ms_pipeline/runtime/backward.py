"""How a Stage gets its gradients: three small strategies behind one interface.

* :class:`ExplicitPasses` (the default when every block has ``explicit_passes()``, as
  ``ms_models.pipeline_blocks`` do): F keeps what each block's backward needs, B computes the
  input gradient and each weight's output gradient from it without re-running the forward, W is
  the kept pairs' GEMMs (``dW = g^T x``); BW is B and W in one call. Gradients accumulate over
  microbatches in numpy (measured on CPU: adding 14 weight-sized tensors took 10 ms as MindSpore
  ops, in a graph or not, and 0.8 ms in numpy). Under ``jit`` each of F, B, W and BW is one
  compiled graph per stage. With ``recompute`` flags, a block keeps only its input from F to B,
  where its forward runs again (in B's compiled graph) right before its backward.
* :class:`~.construct_grads.StoredLinearGrads` (PyNative, blocks without explicit passes): B is
  one ``ms.grad`` for the input gradient and the weights that are not plain linear layers, while
  hooks queue each linear layer's input and output gradient (:mod:`.deferred_dw`); W multiplies
  the queued pairs. The first W is checked once against a full ``ms.grad``.
* :class:`~.construct_grads.RecomputeGrads` (any block, the only way under ``jit`` without explicit
  passes): B is ``ms.grad`` for the input, W ``ms.grad`` for the weights, each re-running the
  stage's forward.

A strategy computes; the :class:`~ms_pipeline.runtime.Stage` keeps the per-microbatch values (FIFO
by microbatch, as any schedule needs) and checks the order of the passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import ops

from ..errors import ScheduleError


def _call(obj: Any, method: str | None = None) -> Any:
    """A plain function calling ``obj`` or ``obj.method`` (``ms.jit`` takes functions, not lambdas)."""
    if method is None:

        def call(*args):
            return obj(*args)

        return call
    bound = getattr(obj, method)

    def run(*args):
        return bound(*args)

    return run


class _PassesCell(ms.nn.Cell):
    """The explicit passes of a stage's blocks chained: forward, backward_input, backward_weight.

    A block marked in ``recompute`` keeps only its inputs between F and B; B runs its forward
    again, inside the same compiled graph, right before its backward."""

    def __init__(self, passes: Sequence[ms.nn.Cell], last: bool, recompute: Sequence[bool]):
        super().__init__(auto_prefix=False)
        names = {id(p): p.name for c in passes for p in c.get_parameters()}
        self.passes = ms.nn.CellList(list(passes))
        self.n = len(passes)
        self.last = last
        self.recompute = tuple(bool(r) for r in recompute)
        for p in self.get_parameters():
            p.name = names[id(p)]
        kernels = {getattr(c, "host_kernels", None) for c in passes}
        #: the numpy kernels (and ``to_host``) every block's W can run on, or None
        self.host_kernels = kernels.pop() if len(kernels) == 1 else None

    def forward(self, x, labels=None):
        saved = ()
        for i in range(self.n):
            inputs = (x, labels) if self.last and i == self.n - 1 else (x,)
            x, s = self.passes[i].forward(*inputs)
            saved = saved + ((inputs if self.recompute[i] else s),)
        return x, saved

    def backward_input(self, saved, g):
        pairs = ()
        for i in range(self.n - 1, -1, -1):
            s = saved[i]
            if self.recompute[i]:
                s = self.passes[i].forward(*s)[1]
            g, p = self.passes[i].backward_input(s, g)
            pairs = (p,) + pairs
        return g, pairs

    def backward_weight(self, pairs, k=None):
        """The weight gradients; ``k``: the blocks' own kernels (None, in a graph) or their
        ``host_kernels`` on numpy pairs."""
        grads = ()
        for i in range(self.n):
            passes = self.passes[i]
            grads = grads + (passes.backward_weight(pairs[i]) if k is None else passes.backward_weight(pairs[i], k))
        return grads

    def backward_full(self, saved, g):
        dx, pairs = self.backward_input(saved, g)
        return dx, self.backward_weight(pairs)

    def backward_weight_flat(self, pairs):
        """:meth:`backward_weight` as one flat tensor, the gradients end to end (see ``_flat``)."""
        return _flat(self.backward_weight(pairs))

    def backward_full_flat(self, saved, g):
        """:meth:`backward_full` with the weight gradients as one flat tensor."""
        dx, pairs = self.backward_input(saved, g)
        return dx, self.backward_weight_flat(pairs)


def one_dtype(weights: Sequence[ms.Parameter]) -> bool:
    """The weights share one dtype, so their gradients can be joined in one flat tensor."""
    return len({p.dtype for p in weights}) == 1


def split_flat(flat: np.ndarray, weights: Sequence[ms.Parameter], where: str) -> list[np.ndarray]:
    """Views of ``flat`` shaped as each weight in turn; an error naming both sizes if they differ."""
    sizes = [int(np.prod(p.shape)) for p in weights]
    if flat.size != sum(sizes):
        raise ScheduleError(f"{where}: the weight gradients hold {flat.size} values, the weights {sum(sizes)}")
    out, offset = [], 0
    for p, size in zip(weights, sizes):
        out.append(flat[offset : offset + size].reshape(tuple(p.shape)))
        offset += size
    return out


def _flat(tensors):
    """The tensors raveled and joined, as one graph output. Measured on CPU (MindSpore 2.10, one
    core, a stage of two d=256 Llama layers): W returning its 14 weight gradients per layer as
    separate outputs took 16-18 ms, the same GEMMs returning one joined tensor 9 ms (the joining
    copy included), and W's GEMMs in numpy 14 ms."""
    return ops.cat([t.reshape(-1) for t in tensors])


def _wait(first_output: Any) -> Any:
    """Wait for a compiled call to finish by reading its first output.

    Under ``jit`` in PyNative, MindSpore 2.10 on CPU returns from the call before the graph has
    run. Reading the graph's first output blocks until it has; reading any other output first
    busy-waits the Python thread meanwhile, taking the core from the graph's kernels (measured, one
    core: a stage's B took 240 ms that way, 48-51 ms when its first output was read first, with
    187 ms of the Python thread's own CPU time against 2). Stage 0's first output is a placeholder
    nobody reads, so the wait must be explicit."""
    if first_output is not None and hasattr(first_output, "asnumpy"):
        first_output.asnumpy()
    return first_output


def _mutable_args(fn: Any) -> Any:
    """Pass tuple arguments (the kept values, pairs, accumulators) to a compiled function as
    variables: a plain tuple argument is a constant to ``ms.jit``, which then compiles again for
    every new value (measured: B 1.6 s per call instead of 0.05 s, memory growing each call)."""

    def call(*args):
        return fn(*(ms.mutable(a) if isinstance(a, tuple) else a for a in args))

    return call


def has_explicit_passes(blocks: Sequence[ms.nn.Cell]) -> bool:
    """Every block has ``explicit_passes()``."""
    return all(callable(getattr(b, "explicit_passes", None)) for b in blocks)


def hooked_for_recompute(blocks: Sequence[ms.nn.Cell]) -> list[str]:
    """Names of the cells carrying saved-tensor hooks (ms-recompute's PyNative recompute): those
    work through the cells' ``construct``, which explicit passes do not call."""
    return [
        name or type(b).__name__
        for b in blocks
        for name, c in b.cells_and_names()
        if getattr(c, "_saved_tensors_pack_hook", None) is not None
    ]


class ExplicitPasses:
    """F keeps the values, B never re-runs the forward, W is the kept pairs' GEMMs: compiled, or
    with ``host_w`` in numpy on the pairs read in place (the host's BLAS, for CPU devices)."""

    name = "explicit"

    def __init__(self, stage, cell: _PassesCell, fns: dict, host_w: bool = False):
        self.stage = stage
        self.cell = cell
        if host_w and cell.host_kernels is None:
            names = [type(c).__name__ for c in cell.passes if getattr(c, "host_kernels", None) is None]
            raise ScheduleError(
                f"stage {stage.index}: host_w=True needs host_kernels on every block's passes, not on {names}"
            )
        self.host_w = bool(host_w)
        self.weights = [p for c in cell.passes for p in c.weights()]
        have, want = {id(p) for p in self.weights}, {id(p): p for p in stage.weights}
        missing = [p.name for i, p in want.items() if i not in have]
        if missing:
            raise ScheduleError(f"stage {stage.index}: the explicit passes give no gradient for {missing}")
        self._fns = fns  # compiled once per blocks and flags, shared by the stages built on them
        #: W and BW return the weight gradients as one flat tensor (every weight of one dtype)
        self.flat = one_dtype(self.weights)
        self._no_grads()

    def _no_grads(self) -> None:
        self._flat_acc: np.ndarray | None = None  # every accumulated gradient, end to end
        self.acc: list[np.ndarray] | None = None  # one per entry of self.weights: views into _flat_acc

    def _fn(self, what: str) -> Any:
        if what not in self._fns:
            fn = _call(self.cell, what)
            if self.stage.jit:
                fn = _mutable_args(ms.jit(fn))
            self._fns[what] = fn
        return self._fns[what]

    def _add(self, grads: Sequence[Any]) -> None:
        grads = [g if isinstance(g, np.ndarray) else g.asnumpy() for g in grads]
        if self.acc is None:
            self._start(grads)
        else:
            for a, g in zip(self.acc, grads):
                a += g

    def _add_flat(self, flat: Any) -> None:
        """Add W's or BW's joined gradients (one flat tensor in the order of ``self.weights``)."""
        flat = flat.asnumpy()
        if self._flat_acc is None:
            self._start([flat])
        elif flat.size != self._flat_acc.size:
            raise ScheduleError(
                f"stage {self.stage.index}: the weight gradients hold {flat.size} values, the weights "
                f"{self._flat_acc.size}"
            )
        else:
            self._flat_acc += flat

    def _start(self, grads: Sequence[np.ndarray]) -> None:
        """The accumulators from the first gradients: one float32 array, a view per weight."""
        self._flat_acc = np.concatenate([np.ravel(g) for g in grads]).astype(np.float32, copy=False)
        self.acc = split_flat(self._flat_acc, self.weights, f"stage {self.stage.index}")

    def _values(self, saved) -> Any:
        values, saved.values = saved.values, None
        return values

    def forward(self, saved) -> Any:
        out, saved.values = self._fn("forward")(*self.stage.args(saved))
        if not self.stage.last:
            saved.x = None  # B needs only the values (the labels neither)
        return out

    def backward_input(self, saved, grad_out) -> Any:
        dx, saved.pairs = self._fn("backward_input")(self._values(saved), grad_out)
        saved.x = saved.labels = None
        return _wait(dx) if self.stage.jit else dx

    def backward_weight(self, saved) -> None:
        if self.host_w:
            k = self.cell.host_kernels
            self._add(self.cell.backward_weight(k.to_host(saved.pairs), k))
        elif self.flat:
            self._add_flat(self._fn("backward_weight_flat")(saved.pairs))
        else:
            self._add(self._fn("backward_weight")(saved.pairs))
        saved.pairs = None

    def backward_full(self, saved, grad_out) -> Any:
        dx, grads = self._fn("backward_full_flat" if self.flat else "backward_full")(self._values(saved), grad_out)
        if self.stage.jit:
            _wait(dx)  # before reading the gradients (see _wait)
        self._add_flat(grads) if self.flat else self._add(grads)
        return dx

    def grads(self) -> dict[int, np.ndarray]:
        out: dict[int, np.ndarray] = {}
        for p, g in zip(self.weights, self.acc or ()):
            out[id(p)] = g.copy() if id(p) not in out else out[id(p)] + g  # a weight two blocks share
        return out

    def set_grads(self, grads: dict[int, np.ndarray]) -> None:
        if not grads:
            self._no_grads()
            return
        seen: set[int] = set()
        acc = []
        for p in self.weights:  # a shared weight's sum goes to its first entry
            g = grads.get(id(p)) if id(p) not in seen else None
            seen.add(id(p))
            acc.append(np.array(g, np.float32) if g is not None else np.zeros(p.shape, np.float32))
        self._start(acc)
