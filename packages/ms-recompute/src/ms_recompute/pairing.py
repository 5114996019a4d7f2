"""Pairs of recomputed layers whose communication overlaps, and the order inside each pair.

MindSpore 2.7's ``recomputation_communication_overlap`` (graph pass ``OverlapRecomputeComm``) takes
the recompute subgraphs in pairs (0, 1), (2, 3), ... and threads ordering edges between them so that
communication k of one runs under the other's computation: A.comm[k] before the users of B.comm[k],
and B.comm[k] before the users of A.comm[k+1]. An odd last subgraph has no partner. Here that
ordering is data: a list of steps per pair, which the runtime executes and a test can read.

A layer's recompute is a program of ``n + 1`` compute segments separated by ``n`` collectives whose
results the recompute needs (a tensor-parallel layer: the all-reduce after the attention's row-parallel
o_proj; the one after the MLP feeds only the residual add, which saves nothing, so the recompute stops
before it). Inside a pair the backward reaches the later layer first, so it leads:

    b.c0 b>0  a.c0 a>0  b<0 b.c1  a<0 a.c1          (n = 1;  c compute,  > issue,  < wait)

b's all-reduce runs while a's first segment computes, and a's while b's second segment does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from .errors import RecomputeError


class Op(str, Enum):
    """What one step of a pair's recompute does."""

    COMPUTE = "c"
    """Run the layer's next compute segment (it consumes the previous collective's result)."""
    ISSUE = ">"
    """Start the layer's pending collective asynchronously."""
    WAIT = "<"
    """Wait for the layer's collective to finish."""


@dataclass(frozen=True)
class Step:
    """One step of a recompute group's order."""

    layer: int
    """The layer it belongs to."""
    op: Op
    """Compute, issue or wait."""
    index: int
    """Segment number (compute) or collective number (issue, wait), from 0."""

    def __str__(self) -> str:
        return f"{self.layer}{self.op.value}{self.index}"


@dataclass(frozen=True)
class RecomputeGroup:
    """Layers recomputed together in the backward: a pair, or one layer alone."""

    layers: tuple[int, ...]
    """The layers in forward order: (a, b) for a pair, (a,) alone."""
    order: tuple[Step, ...]
    """The steps in execution order."""

    @property
    def paired(self) -> bool:
        return len(self.layers) == 2

    def __str__(self) -> str:
        return f"({', '.join(map(str, self.layers))}): " + " ".join(map(str, self.order))


def _alone(layer: int, comms: int) -> tuple[Step, ...]:
    steps: list[Step] = []
    for k in range(comms):
        steps += [Step(layer, Op.COMPUTE, k), Step(layer, Op.ISSUE, k), Step(layer, Op.WAIT, k)]
    return (*steps, Step(layer, Op.COMPUTE, comms))


def _ping_pong(a: int, b: int, comms: int) -> tuple[Step, ...]:
    """b leads (the backward needs it first); each issue is followed by the other layer's compute."""
    steps: list[Step] = []
    for k in range(comms):
        steps += [Step(b, Op.COMPUTE, k), Step(b, Op.ISSUE, k)]
        if k:
            steps.append(Step(a, Op.WAIT, k - 1))
        steps += [Step(a, Op.COMPUTE, k), Step(a, Op.ISSUE, k), Step(b, Op.WAIT, k)]
    steps.append(Step(b, Op.COMPUTE, comms))
    if comms:
        steps.append(Step(a, Op.WAIT, comms - 1))
    steps.append(Step(a, Op.COMPUTE, comms))
    return tuple(steps)


def pair_layers(layers: Sequence[int], comms: int = 1, overlap: bool = True) -> tuple[RecomputeGroup, ...]:
    """Group the fully recomputed ``layers`` into pairs (1st, 2nd), (3rd, 4th), ... in forward
    order, each with its ping-pong order; an odd last layer (or every layer, with ``overlap=False``)
    runs alone: compute, issue, wait, compute."""
    if isinstance(comms, bool) or not isinstance(comms, int) or comms < 0:
        raise RecomputeError(f"comms={comms!r}; expected the number of collectives per recompute (an int >= 0)")
    ordered = list(layers)
    if ordered != sorted(set(ordered)):
        raise RecomputeError(f"layers {ordered} must be distinct and in increasing order")
    groups = []
    i = 0
    while i < len(ordered):
        if overlap and i + 1 < len(ordered):
            a, b = ordered[i], ordered[i + 1]
            groups.append(RecomputeGroup((a, b), _ping_pong(a, b, comms)))
            i += 2
        else:
            groups.append(RecomputeGroup((ordered[i],), _alone(ordered[i], comms)))
            i += 1
    return tuple(groups)


def check_order(group: RecomputeGroup, comms: int) -> None:
    """RecomputeError unless every layer of the group computes segments 0..comms in order, issues
    collective k after segment k and waits for it before segment k+1."""
    for layer in group.layers:
        mine = [s for s in group.order if s.layer == layer]
        want = list(_alone(layer, comms))
        done = {(s.op, s.index) for s in mine}
        if len(mine) != len(want) or done != {(s.op, s.index) for s in want}:
            raise RecomputeError(
                f"group {group}: layer {layer} has steps {[str(s) for s in mine]}, expected {[str(s) for s in want]}"
            )
        position = {(s.op, s.index): i for i, s in enumerate(mine)}
        for k in range(comms):
            if not position[Op.COMPUTE, k] < position[Op.ISSUE, k] < position[Op.WAIT, k] < position[Op.COMPUTE, k + 1]:
                raise RecomputeError(f"group {group}: layer {layer} uses collective {k} out of order")
