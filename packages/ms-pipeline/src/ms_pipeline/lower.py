"""Lowering: insert the sends and receives a schedule needs, and prove it cannot deadlock.

A stage's output activation goes to the next stage's rank (SEND_F after the F, RECV_F before the
consumer's F); its input gradient goes to the previous stage's rank (SEND_B after B/BW, RECV_B
before the consumer's backward). Neighbouring stages on one rank (the turn of ZeroBubbleV's V)
hand tensors over in memory and get no transfer.

:func:`step_simulate` then runs the lowered lists in lock-step, like PyTorch's
``_simulate_comms_compute``: in every step each rank runs its next action if it can; a send can
always run (sends are asynchronous, the runtime uses ``isend``); a receive needs its send to have
run in an earlier step; a computation needs the receives and local computations it depends on.
If a step passes in which no rank can move, the schedule deadlocks.
"""

from __future__ import annotations

from collections import Counter

from .deps import needs
from .errors import ScheduleError
from .grid import format_grid
from .ir import Action, Kind, Schedule
from .messages import message_of


def _comms(part: Action, schedule: Schedule) -> tuple[list[Action], list[Action]]:
    """(receives before, sends after) for one computation."""
    s, m, rank_of = part.stage, part.microbatch, schedule.stage_to_rank
    recvs, sends = [], []
    if part.kind is Kind.F:
        if s > 0 and rank_of[s - 1] != rank_of[s]:
            recvs.append(Action(s, Kind.RECV_F, m))
        if s < schedule.num_stages - 1 and rank_of[s + 1] != rank_of[s]:
            sends.append(Action(s, Kind.SEND_F, m))
    elif part.kind in (Kind.B, Kind.BW):
        if s < schedule.num_stages - 1 and rank_of[s + 1] != rank_of[s]:
            recvs.append(Action(s, Kind.RECV_B, m))
        if s > 0 and rank_of[s - 1] != rank_of[s]:
            sends.append(Action(s, Kind.SEND_B, m))
    return recvs, sends


def lower(schedule: Schedule) -> Schedule:
    """The schedule with SEND_F/RECV_F/SEND_B/RECV_B inserted (unchanged if already lowered)."""
    if schedule.is_lowered:
        return schedule
    ranks = []
    for acts in schedule.actions:
        out: list[Action] = []
        for action in acts:
            recvs, sends = [], []
            for part in action.computes():
                r, s = _comms(part, schedule)
                recvs += r
                sends += s
            out += recvs + [action] + sends
        ranks.append(out)
    return Schedule(schedule.name, schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank, ranks)


def _can_run(action: Action, rank: int, schedule: Schedule, done: set, posted: set, received: set) -> str | None:
    """None if ``action`` can run now, else what it waits for."""
    if action.kind in (Kind.SEND_F, Kind.SEND_B):
        kinds = (Kind.F,) if action.kind is Kind.SEND_F else (Kind.B, Kind.BW)
        if not any((action.stage, k, action.microbatch) in done for k in kinds):
            names = " or ".join(f"{action.stage}{k.value}{action.microbatch}" for k in kinds)
            return f"{names} on this rank (a send needs its data)"
        return None
    if action.kind in (Kind.RECV_F, Kind.RECV_B):
        msg = message_of(action)
        return None if posted[msg] > 0 else f"the matching send {msg}"
    own = {(p.stage, p.kind, p.microbatch) for p in action.computes()}
    for part in action.computes():
        for stage, mb, kinds in needs(part, schedule.num_stages):
            if schedule.stage_to_rank[stage] == rank:
                if not any((stage, k, mb) in done or (stage, k, mb) in own for k in kinds):
                    return " or ".join(f"{stage}{k.value}{mb}" for k in sorted(kinds, key=lambda k: k.value))
            else:
                recv = Kind.RECV_F if part.kind is Kind.F else Kind.RECV_B
                if (recv, part.stage, mb) not in received:
                    return f"{part.stage}{recv.value}{mb} on this rank"
    return None


def step_simulate(schedule: Schedule) -> list[list[Action | None]]:
    """Run a lowered schedule in lock-step; returns the grid (steps x ranks, None = waiting).
    Raises ScheduleError naming the blocked actions if no rank can move, or a send nobody receives."""
    pos = [0] * schedule.num_ranks
    done: set = set()
    posted: Counter = Counter()  # messages sent and not yet received
    received: set = set()
    grid: list[list[Action | None]] = []
    while any(pos[r] < len(schedule.actions[r]) for r in range(schedule.num_ranks)):
        row: list[Action | None] = [None] * schedule.num_ranks
        new_posts, waits = [], {}
        for r, acts in enumerate(schedule.actions):
            if pos[r] >= len(acts):
                continue
            action = acts[pos[r]]
            why = _can_run(action, r, schedule, done, posted, received)
            if why is not None:
                waits[r] = (pos[r], action, why)
                continue
            row[r] = action
            pos[r] += 1
            if action.kind in (Kind.SEND_F, Kind.SEND_B):
                new_posts.append(message_of(action))
            elif action.kind in (Kind.RECV_F, Kind.RECV_B):
                received.add((action.kind, action.stage, action.microbatch))
                posted[message_of(action)] -= 1
            for part in action.computes():
                done.add((part.stage, part.kind, part.microbatch))
        if all(a is None for a in row):
            raise _deadlock(schedule, waits)
        posted.update(new_posts)  # a message is visible from the next step on
        grid.append(row)
    lost = sorted((m for m, n in posted.items() if n > 0), key=lambda t: (t[1], t[2], t[0].value))
    if lost:
        raise ScheduleError(f"{lost[0]} is sent but never received ({len(lost)} such sends)")
    return grid


def _deadlock(schedule: Schedule, waits: dict) -> ScheduleError:
    lines = [f"deadlock: no rank can move in schedule {schedule.name}"]
    for r, (step, action, why) in sorted(waits.items()):
        lines.append(f"  rank {r} step {step}: {action} waits for {why}")
    marks = {(r, step) for r, (step, _, _) in waits.items()}
    return ScheduleError("\n".join(lines) + "\n" + format_grid(schedule, marks))
