"""Checks of a measured timeline against the schedule it ran.

A real run records one :class:`~ms_pipeline.simulate.Event` per action on each rank (wall-clock
times, comparable across the processes of one host). Whatever the machine's speed, a correct run
obeys three rules that :func:`check_trace` verifies exactly:

* each rank ran its computations in the schedule's order, each once;
* a rank's computations never overlap (one runs after the previous ended);
* no computation started before the computations it depends on (:func:`~ms_pipeline.deps.needs`)
  had ended, on whichever rank they ran.

Given those, :func:`replay` is a lower bound: the same schedule played with each action's measured
duration and free transfers cannot end later than the measured step did, so the measured bubble
rate is at least the replayed one. What separates them is communication and waiting that the
durations do not contain.
"""

from __future__ import annotations

from collections.abc import Sequence

from .deps import Key, needs, play
from .ir import Schedule
from .simulate import Bubbles, Event


def _compute_events(events: Sequence[Event], num_ranks: int) -> list[list[Event]]:
    """Each rank's computation events, in start order."""
    by_rank: list[list[Event]] = [[] for _ in range(num_ranks)]
    for e in events:
        if e.action.is_compute:
            by_rank[e.rank].append(e)
    return [sorted(mine, key=lambda e: e.start) for mine in by_rank]


def check_trace(schedule: Schedule, events: Sequence[Event], slack: float = 1e-3) -> list[str]:
    """Every way ``events`` break the schedule's order or its dependencies (empty: none).

    ``slack`` (seconds) absorbs clock granularity between processes; an F that starts before the
    F feeding it ended by more than that is reported."""
    bad_ranks = sorted({e.rank for e in events if not 0 <= e.rank < schedule.num_ranks})
    if bad_ranks:
        return [f"events name ranks {bad_ranks} outside 0..{schedule.num_ranks - 1}"]
    ran = _compute_events(events, schedule.num_ranks)
    problems: list[str] = []
    where: dict[Key, Event] = {}
    for rank, mine in enumerate(ran):
        planned = [str(a) for a in schedule.actions[rank] if a.is_compute]
        done = [str(e.action) for e in mine]
        if done != planned:
            first = next((i for i, (a, b) in enumerate(zip(done, planned)) if a != b), min(len(done), len(planned)))
            problems.append(
                f"rank {rank} ran {len(done)} computations, planned {len(planned)}; first difference at"
                f" position {first}: ran {done[first] if first < len(done) else 'nothing'},"
                f" planned {planned[first] if first < len(planned) else 'nothing'}"
            )
        for before, after in zip(mine, mine[1:]):
            if after.start < before.end - slack:
                early = before.end - after.start
                problems.append(f"rank {rank}: {after.action} started {early:.6f} s before {before.action} ended")
        for e in mine:
            for part in e.action.computes():
                where[part.stage, part.kind, part.microbatch] = e
    for mine in ran:
        for e in mine:
            for part in e.action.computes():
                for stage, mb, kinds in needs(part, schedule.num_stages):
                    deps = [where[k] for k in ((stage, kind, mb) for kind in kinds) if k in where]
                    if not deps:
                        problems.append(f"{part} on rank {e.rank} ran without {stage}{'/'.join(sorted(kinds))}{mb}")
                    for dep in deps:
                        if dep is not e and e.start < dep.end - slack:
                            problems.append(
                                f"{part} on rank {e.rank} started {dep.end - e.start:.6f} s before {dep.action}"
                                f" (rank {dep.rank}) ended"
                            )
    return problems


def replay(schedule: Schedule, events: Sequence[Event]) -> Bubbles:
    """The schedule played with each computation's measured duration and free transfers: its
    makespan is a lower bound of the measured one (see the module docstring)."""
    ran = _compute_events(events, schedule.num_ranks)
    durations = {(e.rank, str(e.action)): e.end - e.start for mine in ran for e in mine}

    def duration(action) -> float:
        rank = schedule.stage_to_rank[action.computes()[0].stage]
        return durations[rank, str(action)]

    played = play(schedule.compute_only(), duration, lambda dep, part: 0.0)
    if played.stuck:
        raise ValueError(f"the schedule does not play to its end: {played.stuck[0]}")
    compute = [[a for a in acts if a.is_compute] for acts in schedule.actions]
    timeline = [
        Event(r, a, played.start[r][i], played.end[r][i]) for r, acts in enumerate(compute) for i, a in enumerate(acts)
    ]
    return Bubbles.of(timeline, schedule.num_ranks)
