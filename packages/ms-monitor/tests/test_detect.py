"""Detectors: a straggler is found within a few steps; noise and level shifts do not raise false alerts."""

import json
from pathlib import Path

import numpy as np
import pytest

from ms_monitor import Detector, DetectorConfig, MonitorError
from ms_monitor.detect import peer_stats, slow_ranks, step_jitter
from ms_monitor.straggler import RatioWindow


def run(detector, busy_by_step, step_time_by_step=None, synchronous=False):
    """Feed steps (list of {rank: busy}) like the store does; return the alert onsets still active.
    `synchronous`: every rank's step lasts as long as the slowest rank's busy time (data parallelism),
    and the wall time advances by it."""
    alerts, now = [], 0.0
    for step, busy in enumerate(busy_by_step, 1):
        times = busy if step_time_by_step is None else step_time_by_step[step - 1]
        if synchronous:
            now += max(busy.values())
            times = dict.fromkeys(busy, max(busy.values()))
        for rank, t in times.items():
            alerts += detector.update_rank(rank, step, t, now if synchronous else None)
        alerts += detector.update_step(step, busy)
    return [a for a in alerts if a.active]


def slow_rank_alerts(detector, busy_by_step):
    """Every slow-rank alert, in the order raised, whether resolved since or not."""
    seen = []
    for step, busy in enumerate(busy_by_step, 1):
        for rank, t in busy.items():
            detector.update_rank(rank, step, t)
        for a in detector.update_step(step, busy):
            if a.kind == "slow_rank" and all(a is not b for b in seen):
                seen.append(a)
    return seen


def noisy_steps(rng, n_steps, n_ranks, base=0.05, sigma=0.05):
    return [{r: base * float(rng.lognormal(0, sigma)) for r in range(n_ranks)} for _ in range(n_steps)]


def deschedule(rng, steps, rate=0.02):
    """Descheduling bursts as on a loaded 2-core host: a rank not in a burst (nor in the step after
    one) starts one with probability `rate` per step: 3-6x its busy time for 3-5 steps. Returns the
    bursts as (rank, first step index, length)."""
    bursts, free_from = [], dict.fromkeys(steps[0], 0)
    for i in range(len(steps)):
        for rank in steps[i]:
            if i >= free_from[rank] and rng.random() < rate:
                length, factor = int(rng.integers(3, 6)), float(rng.uniform(3.0, 6.0))
                for s in steps[i : i + length]:
                    s[rank] *= factor
                bursts.append((rank, i, length))
                free_from[rank] = i + length + 1
    return bursts


def test_slow_ranks_uses_peers_median_and_mad():
    cfg = DetectorConfig()
    assert slow_ranks({0: 1.0, 1: 1.0, 2: 1.02, 3: 2.0}, cfg) == {3: 1.0}
    assert slow_ranks({0: 1.0, 1: 1.1, 2: 0.9, 3: 1.25}, cfg) == {}  # under 1.3x
    assert slow_ranks({0: 1.0, 1: 1.5}, cfg) == {1: 1.0}  # two ranks: ratio only
    # a rank 1.4x the median of very noisy peers is within their spread
    assert slow_ranks({0: 1.0, 1: 0.5, 2: 1.5, 3: 0.6, 4: 1.4}, cfg) == {}


@pytest.mark.parametrize("n", [2, 3, 7, 8, 9, 16])
def test_peer_stats_median_is_the_median_of_the_others(n):
    rng = np.random.default_rng(n)
    for _ in range(50):
        values = rng.choice([0.04, 0.05, 0.06], n) if n > 3 else rng.random(n)  # ties too
        busy = dict(enumerate(values.tolist()))
        stats = peer_stats(busy)
        assert [stats[r][0] for r in busy] == pytest.approx([np.median(np.delete(values, r)) for r in busy])


def test_injected_straggler_flagged_within_slow_steps():
    rng = np.random.default_rng(0)
    steps = noisy_steps(rng, 60, 8)
    onset = 40
    for s in steps[onset - 1 :]:
        s[5] += 0.03  # rank 5 sleeps 30 ms from step 40 on
    cfg = DetectorConfig(slow_excess_seconds=0.0)
    alerts = run(Detector(cfg), steps)
    slow = [a for a in alerts if a.kind == "slow_rank"]
    assert [(a.rank, a.step) for a in slow] == [(5, onset + cfg.slow_steps - 1)]  # its 10th slow step
    assert slow[0].value / slow[0].reference == pytest.approx(1.6, rel=0.1)


def test_straggler_raised_once_its_excess_adds_up():
    # 30 ms over 50 ms peers: 0.5 s of excess (the default) takes 17 steps; 0.09 s takes 3 (the excess
    # rule alone, with the 3 slow steps of its first version)
    rng = np.random.default_rng(0)
    steps = noisy_steps(rng, 80, 8)
    onset = 40
    for s in steps[onset - 1 :]:
        s[5] += 0.03
    for excess, first in ((0.5, onset + 16), (0.09, onset + 2)):
        cfg = DetectorConfig(slow_steps=3, slow_excess_seconds=excess, slow_window=0)
        slow = [a for a in run(Detector(cfg), steps) if a.kind == "slow_rank"]
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
    descheduled for 3-5 steps at 2-6x their peers; the sleeping rank (250 ms, 12-30x its peers) is
    flagged at its 10th slow step (slow_steps: a burst lasted up to 5 steps here, 8 on 2 ranks), and
    nothing else is."""
    runs = json.loads((Path(__file__).parent / "data" / "loaded_host_busy.json").read_text())["runs"]
    for rec in runs:
        raised = replay(Detector(), rec)
        assert [a.rank for a in raised] == [rec["slow_rank"]]
        assert raised[0].step == rec["onset"] + DetectorConfig().slow_steps - 1
    # 3 slow steps without the excess condition raise false alerts on the same data (what this test guards)
    loose = DetectorConfig(slow_steps=3, slow_excess_seconds=0.0, slow_window=0)
    false = [a for rec in runs for a in replay(Detector(loose), rec)]
    assert [a for a in false if a.rank != 2]


def test_no_false_alert_in_250_noisy_steps_with_descheduling_bursts():
    """A synchronous job on a loaded host: noise, isolated slow steps and, on average, a 3-5 step burst
    at 3-6x on one of the 8 ranks every 6 steps; nothing is raised in 250 steps (5 seeds)."""
    blamed_by_first_version = 0
    for seed in range(1, 6):
        rng = np.random.default_rng(seed)
        steps = noisy_steps(rng, 250, 8, sigma=0.08)
        for s in steps[::17]:
            s[int(rng.integers(8))] *= 2.5  # isolated slow steps (a GC pause, a page fault)
        bursts = deschedule(rng, steps)
        assert len(bursts) >= 25  # 8 ranks x 250 steps x 0.02, less the steps spent in bursts
        assert run(Detector(), steps, synchronous=True) == [], seed
        # the slow-rank rule of the first version (3 slow steps, 0.5 s of excess) blames descheduled
        # ranks: a 5-step burst at 6x on 50 ms steps costs 1.25 s
        first_version = DetectorConfig(slow_steps=3, slow_window=0)
        blamed = slow_rank_alerts(Detector(first_version), steps)
        assert {a.rank for a in blamed} <= {rank for rank, _, _ in bursts}
        blamed_by_first_version += len(blamed)
    assert blamed_by_first_version >= 5


def window_reference(steps, rank, window=15, share=0.85, ratio=1.07, spread=1.5, warmup=3, resolve=10):
    """The windowed test recomputed with numpy: the steps at which it raises and resolves for `rank`."""
    busy = np.array([[s[r] for r in sorted(s)] for s in steps])[warmup:]
    ratios = busy[:, rank] / np.median(np.delete(busy, rank, axis=1), axis=1)
    windows = np.sort(np.lib.stride_tricks.sliding_window_view(ratios, window), axis=1)  # full windows
    steady = windows[:, window // 2] / windows[:, window // 4] <= spread
    persistent = ((windows >= ratio).sum(axis=1) >= np.ceil(share * window)) & steady
    first = int(np.argmax(persistent))
    quiet = np.convolve(~persistent[first:], np.ones(resolve, int))[: len(persistent) - first] == resolve
    step = warmup + window  # the step of the first full window
    return step + first, step + first + int(np.argmax(quiet))


def test_20pct_straggler_raised_within_15_steps_and_resolved_after_it_recovers():
    """+20 % (10 ms on 50 ms steps) from step 41 to step 100 on 8 noisy ranks, after descheduling
    bursts: raised by the windowed test within 15 steps, once, and resolved after the recovery at
    the steps a numpy recomputation of the test gives."""
    onset, recovered = 41, 101
    for seed in range(10):
        rng = np.random.default_rng(seed)
        steps = noisy_steps(rng, 130, 8)
        deschedule(rng, steps[:onset], rate=0.01)  # before the straggler (bursts during it may delay it)
        for s in steps[onset - 1 : recovered - 1]:
            s[7] *= 1.2
        slow = slow_rank_alerts(Detector(), steps)
        assert [a.rank for a in slow] == [7], seed
        assert onset <= slow[0].step <= onset + 14, (seed, slow[0].step)
        assert "of the last 15 steps" in slow[0].message
        assert not slow[0].active and slow[0].resolved_step >= recovered
        assert (slow[0].step, slow[0].resolved_step) == window_reference(steps, 7), seed


def test_real_2_rank_runs_on_a_loaded_box():
    """Busy times the daemon received from real 2-rank runs on a loaded 2-core host (run queue 5.6-8.1,
    ``benchmarks/_monitor_loaded.py``): in the clean runs one rank fell behind the other at 1.3-1.8x
    for up to 8 steps in a row, which 6 slow steps in a row (the default before) raised; nothing is
    raised now, and the 20 % straggler is raised by the windowed test at the step a numpy
    recomputation of it gives, for rank 1 only."""
    runs = json.loads((Path(__file__).parent / "data" / "loaded_box_2ranks.json").read_text())["runs"]
    for rec in runs:
        raised = replay(Detector(), rec)
        if rec["slow_rank"] is None:
            assert raised == [], rec["name"]
            continue
        assert {a.rank for a in raised} == {1} and raised[0].step >= rec["onset"], rec["name"]
        steps = [dict(zip(rec["ranks"], (row[j] / 1e3 for row in rec["busy_ms"]))) for j in range(len(rec["steps"]))]
        assert raised[0].step == window_reference(steps, 1)[0], rec["name"]
    before = DetectorConfig(slow_steps=6)
    assert [a for rec in runs if rec["slow_rank"] is None for a in replay(Detector(before), rec)]


def test_windowed_test_exact_steps_without_noise():
    # peers at exactly 50 ms, rank 3 at 60 ms from step 11 to 40: the 13th elevated step of the window
    # (13 = 0.85 x 15, rounded up) raises; after the recovery at step 41 the count falls to 12 at step
    # 43, then 10 good steps in a row (max(slow_steps, hold_steps)) resolve (step 52)
    steps = [{r: 0.06 if r == 3 and 11 <= i <= 40 else 0.05 for r in range(4)} for i in range(1, 61)]
    det = Detector()
    out = []
    for step, busy in enumerate(steps, 1):
        for rank, t in busy.items():
            out += det.update_rank(rank, step, t)
        out += det.update_step(step, busy)
    assert len(out) == 2 and out[0] is out[1]
    assert (out[0].rank, out[0].kind, out[0].step, out[0].resolved_step) == (3, "slow_rank", 23, 52)
    assert out[0].value / out[0].reference == pytest.approx(1.2)


def test_ratio_window_counts_bursts_like_any_slow_step():
    w = RatioWindow(15)
    for r in [1.0] * 4 + [6.0] * 5 + [1.0] + [5.0] * 5:  # two 5-step bursts: 10 of 15
        w.push(r)
    assert w.full() and w.fraction_at_least(1.07) == pytest.approx(10 / 15)
    assert not w.persistent(1.07, 0.85)
    for r in [1.1] * 3:  # three more elevated steps, however small: 13 of 15 (the oldest fall out)
        w.push(r)
    assert w.fraction_at_least(1.07) == pytest.approx(13 / 15) and w.persistent(1.07, 0.85)
    # ... but not steady: sorted 1, 1, 1.1 x 3, 5 x 5, 6 x 5, the median (5) is 5 / 1.1 of the lower quartile
    assert w.lower_spread() == pytest.approx(5 / 1.1) and not w.persistent(1.07, 0.85, 1.5)
    # a steady straggler (1.2x) that the host descheduled for 5 of its steps is
    for r in [1.0] * 2 + [1.2] * 4 + [5.0] * 5 + [1.2] * 4:
        w.push(r)
    assert w.lower_spread() == pytest.approx(1.0) and w.persistent(1.07, 0.85, 1.5)
    assert not RatioWindow(15).persistent(1.07, 0.85)  # an empty window says nothing


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
    "kw",
    [
        {"slow_ratio": 1.0},
        {"slow_steps": 0},
        {"slow_excess_seconds": -1},
        {"jitter_cv": 0},
        {"warmup_steps": -1},
        {"slow_window": 3},
        {"slow_window": 15.5},
        {"slow_window": -1},
        {"slow_window_ratio": 1.0},
        {"slow_window_fraction": 0.5},
        {"slow_window_fraction": 1.2},
        {"slow_window_spread": 1.0},
    ],
)
def test_bad_config_is_refused(kw):
    with pytest.raises(MonitorError) as err:
        DetectorConfig(**kw)
    name, value = next(iter(kw.items()))
    if name.startswith("slow_window"):
        assert f"DetectorConfig.{name}={value!r}" in str(err.value)


def test_window_can_be_turned_off():
    assert DetectorConfig(slow_window=0).slow_window == 0


def test_regression_must_last_sustain_seconds():
    # 0.5 s steps: a 4-second burst of slow steps is load on the host; a 20-second one is a regression.
    def run_with_burst(n_slow):
        det = Detector(DetectorConfig(warmup_steps=0, baseline_steps=10, sustain_seconds=10.0, jitter_window=1000))
        times = [0.5] * 20 + [0.8] * n_slow + [0.5] * 20
        return [a for step, t in enumerate(times, 1) for a in det.update_rank(0, step, t, now=step * 0.5) if a.active]

    assert run_with_burst(8) == []
    raised = run_with_burst(40)
    assert [(a.kind, a.step) for a in raised] == [("regression", 23 + 20)]  # first bad at step 23, +10 s
