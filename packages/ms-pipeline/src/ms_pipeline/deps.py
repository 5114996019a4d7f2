"""Dependencies between computations, and the in-order execution that validation and simulation share.

A computation waits for (Zero Bubble paper, Section 2; the same rules as sail-sg's ``pre_validate``):

* F of stage s      <- F of stage s-1 (its input activation);
* B or BW of s      <- F of s (its saved activations) and the backward (B or BW) of s+1 (its
                       output gradient); the last stage needs only its own F (the loss);
* W of s            <- B of s (the gradients B captured).

Each rank runs its actions strictly in order; an action starts when the previous one on its rank
has ended and each dependency has ended (plus a transfer latency when it ran on another rank).
Sends are asynchronous, so the only way to stall forever is a cycle between program order and
these dependencies: that is a deadlock, and :func:`play` reports the actions stuck at the head of
each rank.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from .ir import Action, Kind, Schedule

Key = tuple[int, Kind, int]
"""(stage, kind, microbatch) of one computation."""


def needs(part: Action, num_stages: int) -> list[tuple[int, int, frozenset[Kind]]]:
    """What computation ``part`` (an F, B, W or BW) waits for: (stage, microbatch, kinds that satisfy it)."""
    s, m = part.stage, part.microbatch
    if part.kind is Kind.F:
        return [(s - 1, m, frozenset({Kind.F}))] if s > 0 else []
    if part.kind in (Kind.B, Kind.BW):
        out = [(s, m, frozenset({Kind.F}))]
        if s < num_stages - 1:
            out.append((s + 1, m, frozenset({Kind.B, Kind.BW})))
        return out
    if part.kind is Kind.W:
        return [(s, m, frozenset({Kind.B}))]
    raise ValueError(f"{part} is not a computation")


def locate(schedule: Schedule) -> dict[Key, list[tuple[int, int]]]:
    """Where each computation runs: key -> [(rank, step), ...] (more than one entry is a duplicate)."""
    where: dict[Key, list[tuple[int, int]]] = {}
    for rank, step, action in schedule.iter_actions():
        for part in action.computes():
            where.setdefault((part.stage, part.kind, part.microbatch), []).append((rank, step))
    return where


@dataclass(frozen=True)
class Stuck:
    """A rank that cannot go on: the action at its head and what it waits for."""

    rank: int
    """The blocked rank."""
    step: int
    """Position of the blocked action in the rank's list."""
    action: Action
    """The blocked action."""
    waiting_for: tuple[str, ...]
    """Each unmet dependency, as text (``3F0 (rank 3 step 5)`` or ``3F0 (nowhere)``)."""


@dataclass(frozen=True)
class Played:
    """Start and end of every computation of a schedule run in order."""

    start: tuple[tuple[float, ...], ...]
    """start[rank][step]"""
    end: tuple[tuple[float, ...], ...]
    """end[rank][step]"""
    stuck: tuple[Stuck, ...]
    """Empty when every action ran; otherwise the blocked heads (a deadlock)."""


def play(
    schedule: Schedule,
    duration: Callable[[Action], float],
    latency: Callable[[Action, Action], float],
) -> Played:
    """Run the computations of ``schedule`` in order. ``duration(action)`` is its run time;
    ``latency(dep, part)`` is added when the dependency ``dep`` ran on another rank than ``part``.
    Sends and receives are ignored (transfers are modelled by ``latency``)."""
    acts = [[a for a in rank if a.is_compute] for rank in schedule.actions]
    where = locate(schedule.compute_only())
    ends: dict[Key, float] = {}
    starts_out = [[0.0] * len(a) for a in acts]
    ends_out = [[0.0] * len(a) for a in acts]
    pos = [0] * len(acts)
    clock = [0.0] * len(acts)
    # A worklist of ranks whose head may have become ready: a computation of stage s can only
    # unblock computations of stages s-1, s and s+1 (see needs), so only their ranks are looked
    # at again. Sweeping every rank until nothing moves took p sweeps of p ranks (the backward
    # travels one rank per sweep): minutes for 2048 ranks. Start times do not depend on the
    # order ranks are looked at: each is fixed by the rank's clock and its dependencies' ends.
    placement, last = schedule.stage_to_rank, schedule.num_stages - 1
    queue, queued = deque(range(len(acts))), [True] * len(acts)
    while queue:
        r = queue.popleft()
        queued[r] = False
        rank_acts = acts[r]
        while pos[r] < len(rank_acts):
            ready = _ready_time(rank_acts[pos[r]], schedule, ends, latency)
            if ready is None:
                break
            action = rank_acts[pos[r]]
            start = max(clock[r], ready)
            clock[r] = start + duration(action)
            starts_out[r][pos[r]], ends_out[r][pos[r]] = start, clock[r]
            for part in action.computes():
                ends[part.stage, part.kind, part.microbatch] = clock[r]
                for stage in (part.stage - 1, part.stage + 1):
                    if 0 <= stage <= last and not queued[placement[stage]] and placement[stage] != r:
                        queued[placement[stage]] = True
                        queue.append(placement[stage])
            pos[r] += 1
    stuck = tuple(
        _stuck(r, pos[r], acts[r][pos[r]], schedule, ends, where) for r in range(len(acts)) if pos[r] < len(acts[r])
    )
    return Played(tuple(map(tuple, starts_out)), tuple(map(tuple, ends_out)), stuck)


def _ready_time(action: Action, schedule: Schedule, ends: dict, latency: Callable) -> float | None:
    """Earliest start allowed by the dependencies, or None while one has not run yet."""
    own = {(p.stage, p.kind, p.microbatch) for p in action.computes()}
    ready = 0.0
    for part in action.computes():
        for stage, mb, kinds in needs(part, schedule.num_stages):
            keys = [(stage, k, mb) for k in kinds if (stage, k, mb) in ends]
            if not keys:
                if any((stage, k, mb) in own for k in kinds):
                    continue  # the other half of the same pair cannot feed it
                return None
            extra = 0.0
            if schedule.stage_to_rank[stage] != schedule.stage_to_rank[part.stage]:
                extra = latency(Action(stage, keys[0][1], mb), part)
            ready = max(ready, ends[keys[0]] + extra)
    return ready


def _stuck(rank: int, step: int, action: Action, schedule: Schedule, ends: dict, where: dict) -> Stuck:
    waiting = []
    for part in action.computes():
        for stage, mb, kinds in needs(part, schedule.num_stages):
            if any((stage, k, mb) in ends for k in kinds):
                continue
            found = [(k, loc) for k in sorted(kinds, key=lambda k: k.value) for loc in where.get((stage, k, mb), [])]
            if found:
                k, (r, s) = found[0]
                waiting.append(f"{stage}{k.value}{mb} (rank {r} step {s})")
            else:
                names = " or ".join(f"{stage}{k.value}{mb}" for k in sorted(kinds, key=lambda k: k.value))
                waiting.append(f"{names} (nowhere)")
    return Stuck(rank, step, action, tuple(waiting))
