"""Schedule transforms: a schedule in, a schedule out, validated, simulated and drawn like any other.

:func:`fuse_adjacent_backward` turns each B that its own W follows directly on the same rank into
one BW. The order of the computations stays as built; what changes is that dx leaves the stage
after the W instead of before it (the send follows the fused pass), which delays the previous
stage's B by T_W. It pays when a runtime's fused backward is cheaper than B and W apart (on CPU
with MindSpore, measured: BW ~ 0.8 x (B + W), one graph with the values still in cache), which
the simulator sees through ``CostModel.bw``. W's that the schedule moved away from their B (the
ones filling bubbles: ZeroBubbleV's cool-down) stay separate, so the bubbles stay filled.

:func:`fuse_backward` fuses chosen B's with their W wherever the W stands: the W moves up to its B.
:func:`fuse_where_faster` chooses them: it fuses one B at a time, keeping each fusion only if the
simulator, under the given (measured) costs, finds the step no longer, until no fusion helps. Where
the split costs nothing (BW = B + W) it keeps the W's that fill bubbles apart; where the split costs
more (on CPU the W reads its pairs back from memory: measured BW 0.8 x (B + W)) it fuses every B
whose W fills no bubble, including W's the schedule had moved away from their B.

:func:`split_pairs` is how the runtime executes a 1B1F pair by default: its halves one after
the other, each with its own transfers at its own edges (the forward's receive waited for before
the forward, its send started right after it, while the backward half computes; the backward's
receive waited for only after the forward half ran). Lowering the pair as one action would
instead wait for both receives before the forward and start both sends after the backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from .errors import ScheduleError
from .ir import Action, Kind, Schedule
from .lower import lower
from .simulate import CostModel, simulate


def fuse_adjacent_backward(schedule: Schedule) -> Schedule:
    """``schedule`` with every "sBm sWm" pair that is adjacent in a rank's computations replaced by
    one "sBWm" (named ``<name>+fused``). Works on computation lists; lower the result afterwards."""
    if schedule.is_lowered:
        raise ScheduleError(f"fuse_adjacent_backward takes a schedule before lowering, {schedule.name} is lowered")
    ranks = []
    for actions in schedule.actions:
        out: list[Action] = []
        for action in actions:
            prev = out[-1] if out else None
            if (
                action.kind is Kind.W
                and prev is not None
                and prev.kind is Kind.B
                and (prev.stage, prev.microbatch) == (action.stage, action.microbatch)
            ):
                out[-1] = Action(action.stage, Kind.BW, action.microbatch)
            else:
                out.append(action)
        ranks.append(tuple(out))
    return dataclasses.replace(schedule, name=f"{schedule.name}+fused", actions=tuple(ranks))


def fuse_backward(schedule: Schedule, which: Iterable[tuple[int, int]] | None = None) -> Schedule:
    """``schedule`` with the B of each (stage, microbatch) in ``which`` (every B if None) run as one
    BW at the B's place, its W removed from wherever it stood (named ``<name>+fused``). B's inside
    1B1F pairs are left as they are. Works on computation lists; lower the result afterwards."""
    if schedule.is_lowered:
        raise ScheduleError(f"fuse_backward takes a schedule before lowering, {schedule.name} is lowered")
    chosen = None if which is None else {(int(s), int(m)) for s, m in which}
    bs = {(a.stage, a.microbatch) for actions in schedule.actions for a in actions if a.kind is Kind.B}
    if chosen is not None and chosen - bs:
        raise ScheduleError(f"fuse_backward: {sorted(chosen - bs)[:5]} name no separate B of {schedule.name}")
    fuse = bs if chosen is None else chosen
    ranks = []
    for actions in schedule.actions:
        out = []
        for a in actions:
            key = (a.stage, a.microbatch)
            if a.kind is Kind.W and key in fuse:
                continue
            out.append(Action(a.stage, Kind.BW, a.microbatch) if a.kind is Kind.B and key in fuse else a)
        ranks.append(tuple(out))
    name = schedule.name if schedule.name.endswith("+fused") else f"{schedule.name}+fused"
    return dataclasses.replace(schedule, name=name, actions=tuple(ranks))


def fuse_where_faster(schedule: Schedule, costs: CostModel, *, tolerance: float = 1e-9) -> Schedule:
    """``schedule`` with each B fused with its W (:func:`fuse_backward`) where the simulator, under
    ``costs`` (its ``bw`` the fused pass's time), finds the step no longer for it (within
    ``tolerance``, relative; a tie fuses, which frees the B's kept values sooner). Greedy: the B's
    are tried in each rank's order, one at a time against the schedule chosen so far, in passes
    until one changes nothing. Named ``<name>+auto``. Costs one simulation per B and pass."""
    if schedule.is_lowered:
        raise ScheduleError(f"fuse_where_faster takes a schedule before lowering, {schedule.name} is lowered")
    if not 0.0 <= tolerance < 1.0:
        raise ScheduleError(f"tolerance={tolerance!r} must be within [0, 1)")
    candidates = [(a.stage, a.microbatch) for actions in schedule.actions for a in actions if a.kind is Kind.B]
    fused: set[tuple[int, int]] = set()
    best = simulate(schedule, costs).makespan
    changed = True
    while changed:
        changed = False
        for key in candidates:
            if key in fused:
                continue
            makespan = simulate(fuse_backward(schedule, fused | {key}), costs).makespan
            if makespan <= best * (1.0 + tolerance):
                fused.add(key)
                best = min(best, makespan)
                changed = True
    out = fuse_backward(schedule, fused)
    return dataclasses.replace(out, name=f"{schedule.name}+auto")


def split_pairs(schedule: Schedule) -> Schedule:
    """``schedule`` with every OVERLAP_F_B pair replaced by its forward half then its backward half
    (lowered or not: a lowered schedule is lowered again around the halves). This is the order the
    runtime executes a pair in when no ``overlap_fn`` is given, so ``simulate(split_pairs(s))``
    predicts that run; the name is kept, since it is the same schedule executed pass by pass."""
    if not any(a.kind is Kind.OVERLAP_F_B for actions in schedule.actions for a in actions):
        return schedule
    base = schedule.compute_only() if schedule.is_lowered else schedule
    ranks = tuple(tuple(part for action in actions for part in action.computes()) for actions in base.actions)
    out = dataclasses.replace(base, actions=ranks)
    return lower(out) if schedule.is_lowered else out


__all__ = ["fuse_adjacent_backward", "fuse_backward", "fuse_where_faster", "split_pairs"]
