"""Detectors: a straggler is found within a few steps; noise and level shifts do not raise false alerts."""

import json
from pathlib import Path

import numpy as np
import pytest

from ms_monitor import Detector, DetectorConfig, MonitorError
from ms_monitor.detect import slow_ranks, step_jitter


def run(detector, busy_by_step, step_time_by_step=None):
    """Feed steps (list of {rank: busy}) like the store does; return the alert onsets."""
    alerts = []
    for step, busy in enumerate(busy_by_step, 1):
        times = busy if step_time_by_step is None else step_time_by_step[step - 1]
        for rank, t in times.items():
            alerts += detector.update_rank(rank, step, t)
        alerts += detector.update_step(step, busy)
    return [a for a in alerts if a.active]


def noisy_steps(rng, n_steps, n_ranks, base=0.05, sigma=0.05):
    return [{r: base * float(rng.lognormal(0, sigma)) for r in range(n_ranks)} for _ in range(n_steps)]


def test_slow_ranks_uses_peers_median_and_mad():
    cfg = DetectorConfig()
    assert slow_ranks({0: 1.0, 1: 1.0, 2: 1.02, 3: 2.0}, cfg) == {3: 1.0}
    assert slow_ranks({0: 1.0, 1: 1.1, 2: 0.9, 3: 1.25}, cfg) == {}  # under 1.3x
    assert slow_ranks({0: 1.0, 1: 1.5}, cfg) == {1: 1.0}  # two ranks: ratio only
    # a rank 1.4x the median of very noisy peers is within their spread
    assert slow_ranks({0: 1.0, 1: 0.5, 2: 1.5, 3: 0.6, 4: 1.4}, cfg) == {}


def test_injected_straggler_flagged_within_slow_steps():
    rng = np.random.default_rng(0)
    steps = noisy_steps(rng, 60, 8)
    onset = 40
    for s in steps[onset - 1 :]:
        s[5] += 0.03  # rank 5 sleeps 30 ms from step 40 on
    alerts = run(Detector(DetectorConfig(slow_excess_seconds=0.0)), steps)
    slow = [a for a in alerts if a.kind == "slow_rank"]
    assert [(a.rank, a.step) for a in slow] == [(5, onset + 2)]
    assert slow[0].value / slow[0].reference == pytest.approx(1.6, rel=0.1)


def test_straggler_raised_once_its_excess_adds_up():
    # 30 ms over 50 ms peers: 0.5 s of excess (the default) takes 17 steps; 0.09 s takes 3
    rng = np.random.default_rng(0)
    steps = noisy_steps(rng, 80, 8)
    onset = 40
    for s in steps[onset - 1 :]:
        s[5] += 0.03
    for excess, first in ((0.5, onset + 16), (0.09, onset + 2)):
        slow = [a for a in run(Detector(DetectorConfig(slow_excess_seconds=excess)), steps) if a.kind == "slow_rank"]
        assert [a.rank for a in slow] == [5]
        assert first - 1 <= slow[0].step <= first + 1, (excess, slow[0].step)


def replay(detector, rec):
    """Feed one recorded run (ms per rank and step) like the store does; the slow-rank onsets."""
    raised = []
    for j, step in enumerate(rec["steps"]):
        for r, row in zip(rec["ranks"], rec["step_ms"]):
            if row[j] is not None:
                detector.update_rank(r, step, row[j] / 1e3)
        busy = {r: row[j] / 1e3 for r, row in zip(rec["ranks"], rec["busy_ms"]) if row[j] is not None}
        raised += [a for a in detector.update_step(step, busy) if a.active and a.kind == "slow_rank"]
    return raised


def test_loaded_host_replay_finds_the_straggler_and_nothing_else():
    """Busy times recorded from the 4-rank gloo job on a 2-core host at load ~10: single ranks were
    descheduled for 3-5 steps at 2-6x their peers; the sleeping rank is flagged within 5 steps of its
    first slow one, and nothing else is."""
    runs = json.loads((Path(__file__).parent / "data" / "loaded_host_busy.json").read_text())["runs"]
    for rec in runs:
        raised = replay(Detector(), rec)
        assert [a.rank for a in raised] == [rec["slow_rank"]]
        assert rec["onset"] <= raised[0].step <= rec["onset"] + 4
    # without the excess condition the same data raises false alerts (what this test guards)
    false = [a for rec in runs for a in replay(Detector(DetectorConfig(slow_excess_seconds=0.0)), rec)]
    assert [a for a in false if a.rank != 2]


def test_no_false_alert_in_200_noisy_steps():
    rng = np.random.default_rng(1)
    steps = noisy_steps(rng, 200, 8, sigma=0.08)
    for s in steps[::17]:
        s[int(rng.integers(8))] *= 2.5  # isolated slow steps (a GC pause, a page fault)
    assert run(Detector(), steps) == []


def test_regression_against_own_baseline_and_resolution():
    det = Detector(DetectorConfig(warmup_steps=2, baseline_steps=10, recent_steps=5, hold_steps=5))
    out = []
    # the 5-step median crosses 1.3x at step 33 and falls back at step 43; 5 evaluations in a row
    # raise and resolve it
    times = [0.05] * 30 + [0.08] * 10 + [0.05] * 10
    for step, t in enumerate(times, 1):
        out += det.update_rank(0, step, t)
    # one alert, returned at its onset and again when resolved
    assert len(out) == 2 and out[0] is out[1]
    assert (out[0].kind, out[0].step, out[0].active, out[0].resolved_step) == ("regression", 37, False, 47)
    assert out[0].value / out[0].reference == pytest.approx(1.6)


def test_jitter_ignores_a_level_shift():
    flat = np.full(30, 0.05)
    shifted = np.concatenate([np.full(15, 0.05), np.full(15, 0.10)])
    rng = np.random.default_rng(2)
    noisy = 0.05 * rng.lognormal(0, 0.6, 30)
    assert step_jitter(flat) == 0.0
    assert step_jitter(shifted) == 0.0
    assert step_jitter(noisy) > 0.35
    det = Detector(DetectorConfig(warmup_steps=0, baseline_steps=5, jitter_window=30, regress_ratio=100))
    alerts = [a for step, t in enumerate(noisy.tolist() * 2, 1) for a in det.update_rank(1, step, t)]
    assert {a.kind for a in alerts} == {"jitter"}


def test_warmup_steps_are_ignored():
    steps = [{0: 1.0, 1: 0.01, 2: 0.01}] * 3 + [{0: 0.01, 1: 0.01, 2: 0.01}] * 10
    assert run(Detector(DetectorConfig(warmup_steps=3)), steps) == []


@pytest.mark.parametrize(
    "kw", [{"slow_ratio": 1.0}, {"slow_steps": 0}, {"slow_excess_seconds": -1}, {"jitter_cv": 0}, {"warmup_steps": -1}]
)
def test_bad_config_is_refused(kw):
    with pytest.raises(MonitorError):
        DetectorConfig(**kw)


def test_regression_must_last_sustain_seconds():
    # 0.5 s steps: a 4-second burst of slow steps is load on the host; a 20-second one is a regression.
    def run_with_burst(n_slow):
        det = Detector(DetectorConfig(warmup_steps=0, baseline_steps=10, sustain_seconds=10.0, jitter_window=1000))
        times = [0.5] * 20 + [0.8] * n_slow + [0.5] * 20
        return [a for step, t in enumerate(times, 1) for a in det.update_rank(0, step, t, now=step * 0.5) if a.active]

    assert run_with_burst(8) == []
    raised = run_with_burst(40)
    assert [(a.kind, a.step) for a in raised] == [("regression", 23 + 20)]  # first bad at step 23, +10 s
