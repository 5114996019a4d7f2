"""Detectors: a straggler is found within a few steps; noise and level shifts do not raise false alerts."""

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
    alerts = run(Detector(), steps)
    slow = [a for a in alerts if a.kind == "slow_rank"]
    assert [(a.rank, a.step) for a in slow] == [(5, onset + 2)]
    assert slow[0].value / slow[0].reference == pytest.approx(1.6, rel=0.1)


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


@pytest.mark.parametrize("kw", [{"slow_ratio": 1.0}, {"slow_steps": 0}, {"jitter_cv": 0}, {"warmup_steps": -1}])
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
