"""check_trace and replay on simulated timelines, where the truth is known, and on broken ones."""

from __future__ import annotations

import dataclasses

import pytest

import ms_pipeline as mp
from ms_pipeline.simulate import Event

COSTS = mp.CostModel(f=2.0, b=3.0, w=1.0, bw=4.0, comm=0.5)


@pytest.mark.parametrize("name,p,m", [("1f1b", 2, 4), ("zbv", 2, 8), ("zbv", 4, 6), ("zbh1", 3, 5)])
def test_a_simulated_run_obeys_its_schedule_and_replays_to_a_lower_bound(name, p, m):
    schedule = mp.build(name, p, m)
    result = mp.simulate(schedule, COSTS)
    assert mp.check_trace(schedule, result.timeline, slack=0.0) == []
    replayed = mp.replay(schedule, result.timeline)
    measured = mp.Bubbles.of(result.timeline, p)
    # the same durations without the transfer latency: never later, and as busy
    assert replayed.busy == pytest.approx(measured.busy)
    assert replayed.makespan <= measured.makespan
    assert replayed.bubble_rate <= measured.bubble_rate + 1e-12
    # and with free transfers in the simulation too, the replay is that simulation exactly
    free = mp.simulate(schedule, dataclasses.replace(COSTS, comm=0.0))
    assert replayed.makespan == pytest.approx(free.makespan)


def _shift(events, which, by):
    moved = dataclasses.replace(events[which], start=events[which].start + by, end=events[which].end + by)
    return [moved if i == which else e for i, e in enumerate(events)]


def test_each_broken_rule_is_named():
    schedule = mp.build("1f1b", 2, 4)
    timeline = list(mp.simulate(schedule, COSTS).timeline)
    # rank 1's first F moved to before rank 0's first F ended: a dependency broken
    first_f1 = next(i for i, e in enumerate(timeline) if e.rank == 1)
    early = _shift(timeline, first_f1, -timeline[first_f1].start)
    problems = mp.check_trace(schedule, early)
    assert any("1F0 on rank 1 started" in p and "0F0 (rank 0) ended" in p for p in problems), problems
    # two computations of rank 0 overlapping
    r0 = [i for i, e in enumerate(timeline) if e.rank == 0]
    overlap = _shift(timeline, r0[1], -(timeline[r0[1]].start - timeline[r0[0]].start) / 2)
    assert any(p.startswith("rank 0: ") and "ended" in p for p in mp.check_trace(schedule, overlap))
    # a computation missing, and one out of its rank's order
    missing = [e for i, e in enumerate(timeline) if i != r0[-1]]
    assert any("rank 0 ran" in p and "planned" in p for p in mp.check_trace(schedule, missing))
    a, b = timeline[r0[0]], timeline[r0[1]]
    swapped = list(timeline)
    swapped[r0[0]], swapped[r0[1]] = (
        Event(a.rank, b.action, a.start, a.end),
        Event(b.rank, a.action, b.start, b.end),
    )
    assert any("first difference at position 0" in p for p in mp.check_trace(schedule, swapped))
    assert mp.check_trace(schedule, [dataclasses.replace(timeline[0], rank=5)]) == [
        "events name ranks [5] outside 0..1"
    ]
