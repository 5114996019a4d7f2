"""Run one rank's part of a schedule: MindSpore computes, ``ms_layout.comm`` moves tensors.

The rank walks its lowered action list in order (``ms_pipeline.lower``). Sends are ``isend``s
that complete in the background; a receive is posted as an ``irecv`` ahead of time -- as soon as
the rank reaches the computation before the one that needs it -- so a transfer overlaps the
computation running meanwhile, and the RECV action only waits for what has not arrived yet.
Every message has its own tag (direction, sending stage, microbatch), so no ordering between two
ranks is assumed beyond what the schedule's dependencies give; the validator has already proved
that those cannot deadlock.

Gradients accumulate over the microbatches (the last stage seeds each backward with 1/m, so they
are the gradient of the mean loss), and :meth:`PipelineRuntime.optimizer_step` applies them with
a MindSpore ``nn`` optimizer (``nn.SGD``/``nn.Adam``; ``mint.optim`` silently does not update on
CPU, see docs/mindspore-cpu.md §10.2).

A 1B1F pair (OVERLAP_F_B) runs, unless an ``overlap_fn`` is given, as its two halves with each
half's transfers at its own edges (:func:`ms_pipeline.split_pairs`): the forward's activation is
already on its way while the backward half computes, and the backward half's gradient has the
forward half's time to arrive. Lowered as one action, the pair would wait for both receives
before it starts and send both results after it ends.

Every computation and every wait for a receive is recorded (wall-clock start and end), so a real
step can be drawn, exported as a Chrome trace and measured like a simulated one; ``order`` holds
every action the rank ran, transfers included, in the order it ran them.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import mindspore as ms
import numpy as np

from ..errors import ScheduleError
from ..ir import Action, Kind, Schedule
from ..lower import lower
from ..messages import Message, message_of
from ..simulate import CostModel, Event, mean_durations
from ..transforms import fuse_backward, fuse_where_faster, split_pairs
from ..validate import validate
from .chained import drain
from .stage import Stage

ShapeFn = Callable[[int], Sequence[int]]


@dataclass(frozen=True)
class StepResult:
    """What one pipelined training step produced on this rank."""

    loss: float
    """Mean loss over the microbatches (the same on every rank)."""
    events: tuple[Event, ...]
    """This rank's computations and receive waits, wall-clock seconds."""
    order: tuple[Action, ...] = ()
    """Every action this rank ran, sends and receives included, in the order it ran them."""
    interleaved: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Per 1B1F pair run by :func:`interleave_layers`: the pair and its halves' steps in the
    order they ran ("F 0>0": the forward half issued layer 0's first collective)."""


def interleave_layers(runtime: PipelineRuntime, forward: Action, backward: Action) -> None:
    """An ``overlap_fn`` that runs a 1B1F pair's halves interleaved at their collectives: the
    forward runs until it has issued a collective (a TP all-reduce inside a layer), then the
    backward until it has issued one, then the forward again (waiting for its collective, which
    was in flight meanwhile), and so on; a half without collectives runs whole at its turn. The
    steps are recorded in ``StepResult.interleaved``. As the pair runs as one action, both its
    receives come before it and both sends after (``PipelineRuntime(overlap_fn=...)`` lowers it so)."""
    halves = [("F", runtime.compute_steps(forward)), ("B", runtime.compute_steps(backward))]
    ran: list[str] = []
    while halves:
        for half in list(halves):
            try:
                ran.append(f"{half[0]} {next(half[1])}")
            except StopIteration:
                halves.remove(half)
    runtime.interleaved.append((str(Action.overlap(forward, backward)), tuple(ran)))


class PipelineRuntime:
    """Executes ``schedule`` on this rank of ``group`` for the stages this rank holds.

    ``blocks[s]`` are the MindSpore Cells of stage s (only this rank's stages are needed).
    ``activation_shape`` is the shape of the tensor crossing from stage s to s+1 (the same shape
    flows back as its gradient), or a function of s; ``dtype`` its numpy dtype.
    ``overlap_fn(runtime, forward, backward)`` runs an OVERLAP_F_B pair (a model with
    communication inside its passes can interleave them, as DualPipe's
    ``overlapped_forward_backward``); by default the pair runs as its halves, each with its own
    transfers at its edges (module docstring). ``jit`` compiles each block's forward and gradients with
    ``mindspore.jit`` (seconds per stage once, then several times faster than PyNative). ``dw``
    says how the backward is computed (see :class:`Stage`): "explicit" runs the blocks' own passes
    (B without a forward re-run, W from the kept pairs), "stored" queues each linear layer's input
    and output gradient in B and multiplies them in W (PyNative), "recompute" runs ``ms.grad``
    twice; "auto" takes "explicit" under ``jit`` where the blocks have explicit passes. ``recompute[s]`` (True or
    one flag per block of stage s) makes those blocks keep only their input from F to B.
    ``host_w`` runs W's GEMMs in numpy on the kept pairs (see :class:`Stage`; None: off).
    ``probe`` (e.g. ms-probe's ``PrecisionDebugger``): each F, B, W and BW runs inside its
    ``pipeline_pass(stage, microbatch, kind)``, so that a dump of the step names every module call
    with its stage, microbatch and pass (PyNative, where the blocks run as Cells)."""

    def __init__(
        self,
        schedule: Schedule,
        blocks: Mapping[int, Sequence[ms.nn.Cell]],
        group: Any,
        *,
        activation_shape: Sequence[int] | ShapeFn,
        dtype: Any = np.float32,
        optimizer: ms.nn.Optimizer | None = None,
        overlap_fn: Callable[[PipelineRuntime, Action, Action], None] | None = None,
        jit: bool = False,
        dw: str = "auto",
        recompute: Mapping[int, bool | Sequence[bool]] | None = None,
        host_w: bool | None = None,
        probe: Any = None,
    ):
        if probe is not None and not callable(getattr(probe, "pipeline_pass", None)):
            raise ScheduleError(f"probe={type(probe).__name__} has no pipeline_pass(stage, microbatch, kind)")
        self.probe = probe
        if group.size != schedule.num_ranks:
            raise ScheduleError(
                f"schedule {schedule.name} needs {schedule.num_ranks} ranks, the group has {group.size}"
            )
        self.group = group
        self.rank = group.rank
        self.overlap_fn = overlap_fn
        self._use(schedule)
        mine = schedule.stages_of(self.rank)
        if sorted(blocks) != sorted(mine):
            raise ScheduleError(
                f"rank {self.rank} holds stages {list(mine)}, but blocks were given for {sorted(blocks)}"
            )
        last = schedule.num_stages - 1
        recompute = dict(recompute or {})
        if set(recompute) - set(mine):
            extra = sorted(set(recompute) - set(mine))
            raise ScheduleError(f"rank {self.rank}: recompute names stages {extra} that it does not hold")
        self.stages = {
            s: Stage(
                s,
                blocks[s],
                first=s == 0,
                last=s == last,
                jit=jit,
                dw=dw,
                recompute=recompute.get(s, False),
                host_w=host_w,
            )
            for s in mine
        }
        self._shape = activation_shape if callable(activation_shape) else (lambda s: tuple(activation_shape))
        self.dtype = np.dtype(dtype)
        self.optimizer = optimizer
        self.costs: CostModel | None = None  # what the last tune_backward measured
        self.interleaved: list[tuple[str, tuple[str, ...]]] = []  # this step's pairs (interleave_layers)

    def _use(self, schedule: Schedule) -> None:
        """Run ``schedule`` from the next step on (the stages stay: a variant of the same cut)."""
        self.schedule = schedule
        # with sends and receives; a pair run as its halves gets each half's transfers at its edges
        executed = schedule if self.overlap_fn is not None else split_pairs(schedule)
        self.actions = validate(lower(executed)).actions[self.rank]
        self._computes = [i for i, a in enumerate(self.actions) if a.is_compute]

    # ------------------------------------------------------------ messages
    def _post(self, action: Action) -> None:
        msg = message_of(action)
        shape = self._shape(msg.sender if msg.direction is Kind.F else action.stage)
        buf = np.empty(tuple(shape), dtype=self.dtype)
        src = self.schedule.stage_to_rank[msg.sender]
        work = self.group.irecv(buf, src, tag=msg.tag(self.schedule.num_microbatches))
        self._posted[action] = (buf, work)

    def _prefetch(self, i: int) -> None:
        """Post the irecvs of every RECV up to the computation after the next one."""
        k = bisect.bisect_left(self._computes, i)
        limit = self._computes[k + 1] if k + 1 < len(self._computes) else len(self.actions) - 1
        while self._next_post <= limit:
            action = self.actions[self._next_post]
            if action.kind in (Kind.RECV_F, Kind.RECV_B) and action not in self._posted:
                self._post(action)
            self._next_post += 1

    def _send(self, direction: Kind, stage: int, mb: int, tensor: Any) -> None:
        array = np.ascontiguousarray(tensor.asnumpy(), dtype=self.dtype)
        expected = tuple(self._shape(stage if direction is Kind.F else stage - 1))
        if array.shape != expected:
            raise ScheduleError(
                f"stage {stage} microbatch {mb}: the {'activation' if direction is Kind.F else 'gradient'} has shape"
                f" {array.shape}, but activation_shape says {expected}"
            )
        msg = Message(direction, stage, mb)
        dst = self.schedule.stage_to_rank[msg.receiver]
        work = self.group.isend(array, dst, tag=msg.tag(self.schedule.num_microbatches))
        self._sends.append((work, array))  # the buffer must outlive the transfer

    def _recv(self, action: Action) -> None:
        if action not in self._posted:
            self._post(action)
        buf, work = self._posted.pop(action)
        start = time.time()
        work.wait()
        self._events.append(Event(self.rank, action, start, time.time()))
        self._inbox[message_of(action).direction, action.stage, action.microbatch] = ms.Tensor.from_numpy(buf)

    # ------------------------------------------------------------ computations
    def _input(self, s: int, mb: int) -> Any:
        if s == 0:
            return self._inputs[mb]
        if self.schedule.stage_to_rank[s - 1] == self.rank:
            return self._outbox.pop((Kind.F, s - 1, mb))  # the turn of a V: handed over in memory
        return self._inbox.pop((Kind.F, s, mb))

    def _grad_output(self, s: int, mb: int) -> Any:
        if s == self.schedule.num_stages - 1:
            return ms.Tensor(1.0 / self.schedule.num_microbatches, ms.float32)
        if self.schedule.stage_to_rank[s + 1] == self.rank:
            return self._outbox.pop((Kind.B, s + 1, mb))
        return self._inbox.pop((Kind.B, s, mb))

    def run_compute(self, part: Action) -> None:
        """Run one F, B, W or BW (public so that an ``overlap_fn`` can run the halves of a pair)."""
        if self.probe is None:
            drain(self.compute_steps(part, steps=False))
            return
        with self.probe.pipeline_pass(part.stage, part.microbatch, part.kind.value):
            drain(self.compute_steps(part, steps=False))

    def compute_steps(self, part: Action, steps: bool = True) -> Generator[str, None, None]:
        """One F, B, W or BW as steps: it yields a label after each collective its stage's blocks
        issue (blocks with passes of their own, such as TP layer stacks), so that an ``overlap_fn``
        can interleave the two halves of a pair (:func:`interleave_layers`); ``steps=False`` runs
        the stage's plain passes (what :meth:`run_compute` does)."""
        s, mb, stage = part.stage, part.microbatch, self.stages[part.stage]
        if part.kind is Kind.F:
            labels = self._labels[mb] if stage.last else None
            x = self._input(s, mb)
            out = (yield from stage.forward_steps(mb, x, labels)) if steps else stage.forward(mb, x, labels)
            out.asnumpy()  # synchronise, so the recorded end time is the real one
            if stage.last:
                self._losses[mb] = float(out.asnumpy())
            else:
                self._outbox[Kind.F, s, mb] = out
        elif part.kind in (Kind.B, Kind.BW):
            name = "backward_input" if part.kind is Kind.B else "backward_full"
            g = self._grad_output(s, mb)
            dx = (yield from getattr(stage, f"{name}_steps")(mb, g)) if steps else getattr(stage, name)(mb, g)
            if dx is not None:
                dx.asnumpy()
            if s > 0:
                self._outbox[Kind.B, s, mb] = dx
        elif part.kind is Kind.W:
            stage.backward_weight(mb)

    def _run(self, action: Action) -> None:
        self._order.append(action)
        kind = action.kind
        if kind in (Kind.SEND_F, Kind.SEND_B):
            direction = Kind.F if kind is Kind.SEND_F else Kind.B
            self._send(
                direction,
                action.stage,
                action.microbatch,
                self._outbox.pop((direction, action.stage, action.microbatch)),
            )
            return
        if kind in (Kind.RECV_F, Kind.RECV_B):
            self._recv(action)
            return
        start = time.time()
        if kind is Kind.OVERLAP_F_B and self.overlap_fn is not None:
            self.overlap_fn(self, *action.parts)
        else:
            for part in action.computes():
                self.run_compute(part)
        self._events.append(Event(self.rank, action, start, time.time()))

    # ------------------------------------------------------------ the step
    def step(self, inputs: Sequence[Any], labels: Sequence[Any]) -> StepResult:
        """Run every action of this rank for one batch of ``num_microbatches`` microbatches.
        ``inputs[m]`` feed stage 0 and ``labels[m]`` the loss of the last stage; ranks that
        hold neither may pass anything of the right length. Gradients accumulate in each
        stage's ``grads`` until :meth:`optimizer_step` (or :meth:`zero_grads`)."""
        m = self.schedule.num_microbatches
        if len(inputs) != m or len(labels) != m:
            raise ScheduleError(
                f"step needs {m} microbatches of inputs and labels, got {len(inputs)} and {len(labels)}"
            )
        self._inputs, self._labels = list(inputs), list(labels)
        self._posted: dict[Action, tuple[np.ndarray, Any]] = {}
        self._inbox: dict[tuple, Any] = {}
        self._outbox: dict[tuple, Any] = {}
        self._sends: list[tuple[Any, np.ndarray]] = []
        self._losses: dict[int, float] = {}
        self._events: list[Event] = []
        self._order: list[Action] = []
        self.interleaved: list[tuple[str, tuple[str, ...]]] = []
        self._next_post = 0
        self.group.barrier()  # a common start, so the ranks' clocks line up in the trace
        for i, action in enumerate(self.actions):
            self._prefetch(i)
            try:
                self._run(action)
            except ScheduleError:
                raise
            except Exception as exc:
                raise RuntimeError(f"rank {self.rank} failed in {action}: {exc}") from exc
        for work, _ in self._sends:
            work.wait()
        if self._posted or self._inbox or self._outbox:
            raise ScheduleError(
                f"rank {self.rank}: tensors left unused after the step: {[*self._posted, *self._inbox, *self._outbox]}"
            )
        total = np.array([sum(self._losses.values()) / m], dtype=np.float64)
        self.group.all_reduce(total)  # only the rank of the last stage adds a non-zero
        return StepResult(float(total[0]), tuple(self._events), tuple(self._order), tuple(self.interleaved))

    def tune_backward(
        self, inputs: Sequence[Any], labels: Sequence[Any], *, steps: int = 1, comm: float = 0.0
    ) -> Schedule:
        """Choose, from this machine's measured costs, which B's run fused with their W, and run
        that schedule from now on; returns it (``<name>+auto``, the same on every rank).

        Runs ``steps`` steps of the schedule as it is (B and W apart) and as many with every B
        fused (:func:`~ms_pipeline.fuse_backward`), gathers each stage's mean F, B, W and BW from
        every rank (:meth:`~ms_pipeline.CostModel.from_events`, ``comm`` the one-way latency of a
        transfer in seconds), and keeps the fusions the simulator finds no slower
        (:func:`~ms_pipeline.fuse_where_faster`). The gradients of those steps are discarded.
        Where the split is free, bubble-filling W's stay apart; where it costs (on CPU a lone W
        reads its pairs back from memory), every W that fills no bubble joins its B. Call it
        on every rank, after a warm-up step (the first step compiles)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ScheduleError(f"tune_backward: steps={steps!r} must be an int >= 1")
        if any(a.kind is Kind.OVERLAP_F_B for acts in self.schedule.actions for a in acts):
            raise ScheduleError(f"tune_backward: {self.schedule.name} has 1B1F pairs; tune the schedule without them")
        base = self.schedule
        if not any(a.kind is Kind.B for acts in base.actions for a in acts):
            raise ScheduleError(f"tune_backward: {base.name} has no separate B to fuse or keep apart")
        events: list[Event] = []
        try:
            for variant in (base, fuse_backward(base)):
                self._use(variant)
                for _ in range(steps):
                    events += self.step(inputs, labels).events
        finally:
            self._use(base)
            self.zero_grads()
        n, mean = base.num_stages, mean_durations(events)
        table = np.full((1, n, 4), np.nan)
        for s in self.stages:
            table[0, s] = [mean.get((s, k), np.nan) for k in (Kind.F, Kind.B, Kind.W, Kind.BW)]
        table = self.group.all_gather(table, axis=0)  # [ranks, stages, 4]: each stage from its rank
        costs = table[(~np.isnan(table[:, :, 0])).argmax(0), np.arange(n)]
        untimed = [f"{s}{k}" for s in range(n) for i, k in enumerate(("F", "B", "W", "BW")) if np.isnan(costs[s, i])]
        if untimed:
            raise ScheduleError(
                f"tune_backward: {', '.join(untimed[:6])} never ran in {base.name}, so it cannot be timed"
            )
        costs = costs.T.tolist()
        model = CostModel(f=costs[0], b=costs[1], w=costs[2], bw=costs[3], comm=comm)
        chosen = fuse_where_faster(base, model)
        self.costs = model
        self._use(chosen)
        return chosen

    # ------------------------------------------------------------ gradients
    @property
    def params(self) -> list[ms.Parameter]:
        """This rank's trainable parameters (each once, even if shared by two stages)."""
        seen: dict[int, ms.Parameter] = {}
        for stage in self.stages.values():
            seen.update(stage.params)
        return list(seen.values())

    def grads(self) -> dict[str, np.ndarray]:
        """Accumulated gradient of each of this rank's parameters, by parameter name."""
        total: dict[int, np.ndarray] = {}
        for stage in self.stages.values():
            for pid, g in stage.grads.items():
                total[pid] = g if pid not in total else total[pid] + g
        out = {}
        for p in self.params:
            g = total.get(id(p))
            out[p.name] = np.zeros(p.shape, dtype=np.float32) if g is None else g
        return out

    def zero_grads(self) -> None:
        for stage in self.stages.values():
            stage.zero_grads()

    def optimizer_step(self) -> None:
        """Apply the accumulated gradients with the optimizer, then zero them."""
        if self.optimizer is None:
            raise ScheduleError("no optimizer was given to the PipelineRuntime")
        grads = self.grads()
        by_name = {p.name: p for p in self.params}
        ordered = []
        for p in self.optimizer.parameters:
            if p.name not in by_name:
                raise ScheduleError(f"the optimizer updates {p.name}, which no stage of rank {self.rank} holds")
            ordered.append(ms.Tensor(grads[p.name]))
        self.optimizer(tuple(ordered))
        self.zero_grads()
