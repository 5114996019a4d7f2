"""Schedule transforms: a schedule in, a schedule out, validated, simulated and drawn like any other.

:func:`fuse_adjacent_backward` turns each B that its own W follows directly on the same rank into
one BW. The order of the computations stays as built; what changes is that dx leaves the stage
after the W instead of before it (the send follows the fused pass), which delays the previous
stage's B by T_W. It pays when a runtime's fused backward is cheaper than B and W apart (on CPU
with MindSpore, measured: BW ~ 0.8 x (B + W), one graph with the values still in cache), which
the simulator sees through ``CostModel.bw``. W's that the schedule moved away from their B (the
ones filling bubbles: ZeroBubbleV's cool-down) stay separate, so the bubbles stay filled.

:func:`split_pairs` is how the runtime executes a 1B1F pair by default: its halves one after
the other, each with its own transfers at its own edges (the forward's receive waited for before
the forward, its send started right after it, while the backward half computes; the backward's
receive waited for only after the forward half ran). Lowering the pair as one action would
instead wait for both receives before the forward and start both sends after the backward.
"""

from __future__ import annotations

import dataclasses

from .errors import ScheduleError
from .ir import Action, Kind, Schedule
from .lower import lower


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


__all__ = ["fuse_adjacent_backward", "split_pairs"]
