"""The straggler detector's trade-off (``bench_monitor.py --detector``): straggler size vs steps to
alert on synthetic busy times, and false alerts on noisy clean runs and on recorded real runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ms_monitor import Detector, DetectorConfig

STEP_S = 0.05
"""The benchmark's step, seconds."""

REPLAY = Path(__file__).resolve().parent.parent / "packages/ms-monitor/tests/data/loaded_host_busy.json"
#: real 2-rank runs of ``_monitor_loaded.py`` (two sittings, each clean + a 20 % straggler from step 100)
REPLAY_2RANKS = REPLAY.parent / "loaded_box_2ranks.json"
STRAGGLER_PCT = (5, 10, 15, 20, 30, 50, 100)


def synthetic_busy(
    rng: np.random.Generator,
    n_steps: int,
    n_ranks: int,
    sigma: float = 0.05,
    burst_rate: float = 0.0,
    straggler: tuple[int, int, float] | None = None,
) -> list[dict[int, float]]:
    """Busy seconds per step and rank: STEP_S x lognormal(0, sigma) noise; a rank out of a burst
    (and not in the step right after one) is descheduled with probability `burst_rate` per step: 3-6x
    for 3-5 steps; `straggler` = (rank, first 1-based step, extra share of STEP_S) adds a steady
    slowdown."""
    busy = STEP_S * rng.lognormal(0.0, sigma, (n_steps, n_ranks))
    free_from = [0] * n_ranks  # first step at which each rank may start a new burst
    for s in range(n_steps):
        for rank in range(n_ranks):
            if s >= free_from[rank] and rng.random() < burst_rate:
                length = int(rng.integers(3, 6))
                busy[s : s + length, rank] *= rng.uniform(3.0, 6.0)
                free_from[rank] = s + length + 1
    if straggler is not None:
        rank, onset, extra = straggler
        busy[onset - 1 :, rank] += extra * STEP_S
    return [{r: float(v) for r, v in enumerate(row)} for row in busy]


def slow_onsets(cfg: DetectorConfig, steps: list[dict[int, float]]) -> list[tuple[int, int]]:
    """(rank, step) of every slow-rank alert raised on these busy times (the store's order of calls)."""
    det, out = Detector(cfg), []
    for step, busy in enumerate(steps, 1):
        for rank, t in busy.items():
            det.update_rank(rank, step, t)
        out += [(a.rank, a.step) for a in det.update_step(step, busy) if a.active and a.kind == "slow_rank"]
    return out


def replay_onsets(cfg: DetectorConfig, rec: dict) -> list[tuple[int, int]]:
    """Slow-rank alerts on one recorded run (ms per rank and step)."""
    det, out = Detector(cfg), []
    for j, step in enumerate(rec["steps"]):
        for r, row in zip(rec["ranks"], rec["step_ms"]):
            if row[j] is not None:
                det.update_rank(r, step, row[j] / 1e3)
        busy = {r: row[j] / 1e3 for r, row in zip(rec["ranks"], rec["busy_ms"]) if row[j] is not None}
        out += [(a.rank, a.step) for a in det.update_step(step, busy) if a.active and a.kind == "slow_rank"]
    return out


def replay_row(data: str, ranks: int, runs: list[dict], name: str, cfg: DetectorConfig) -> dict:
    """False alerts and steps to alert of one detector over recorded runs: an alert is false
    unless it names the run's slow rank at or after its onset (a clean run has slow_rank None)."""
    onsets = [replay_onsets(cfg, rec) for rec in runs]
    return {
        "data": data,
        "ranks": ranks,
        "runs": f"{len(runs)} x {len(runs[0]['steps'])} steps",
        "burst_rate": "recorded",
        "detector": name,
        "false_alerts": sum(
            1
            for rec, o in zip(runs, onsets)
            for r, s in o
            if rec["slow_rank"] is None or r != rec["slow_rank"] or s < rec["onset"]
        ),
        "straggler_steps_to_alert": [
            next((s - rec["onset"] + 1 for r, s in o if r == rec["slow_rank"] and s >= rec["onset"]), None)
            for rec, o in zip(runs, onsets)
            if rec["slow_rank"] is not None
        ],
    }


def detector_tradeoff(seeds: int = 30, ranks: int = 8, onset: int = 41, horizon: int = 100) -> tuple[list, list, dict]:
    """Straggler size vs steps to alert, and false alerts (see the module docstring)."""
    configs = {"default": DetectorConfig(), "first version": DetectorConfig(slow_steps=3, slow_window=0)}
    # (column prefix, detector, burst rate of every rank, the straggler's included)
    variants = [("", configs["default"], 0.0), ("bursts: ", configs["default"], 0.02)]
    variants.append(("first version: ", configs["first version"], 0.0))
    rows = []
    for pct in STRAGGLER_PCT:
        row: dict = {"straggler_pct": pct}
        for prefix, cfg, rate in variants:
            delays = []
            for seed in range(seeds):
                rng = np.random.default_rng(seed)
                straggler = (ranks - 1, onset, pct / 100)
                steps = synthetic_busy(rng, onset - 1 + horizon, ranks, burst_rate=rate, straggler=straggler)
                hits = [s - onset + 1 for r, s in slow_onsets(cfg, steps) if r == ranks - 1 and s >= onset]
                delays.append(hits[0] if hits else np.inf)
            found = sorted(d for d in delays if d < np.inf)
            median = float(np.median(delays))  # misses count as never
            row[f"{prefix}found"] = f"{len(found)}/{seeds}"
            row[f"{prefix}median_steps"] = None if np.isinf(median) else median
            row[f"{prefix}worst_steps"] = found[-1] if len(found) == seeds else None
        rows.append(row)
    runs = json.loads(REPLAY.read_text())["runs"]
    false_rows = []
    false_rows += [replay_row("loaded-host replay", 4, runs, name, cfg) for name, cfg in configs.items()]
    for n_ranks in (4, 8):
        for rate in (0.02, 0.04):
            for name, cfg in configs.items():
                data = [
                    synthetic_busy(np.random.default_rng(1000 + seed), 250, n_ranks, 0.08, rate)
                    for seed in range(seeds)
                ]
                alerts = [len(slow_onsets(cfg, steps)) for steps in data]
                false_rows.append(
                    {
                        "data": "clean, noisy",
                        "ranks": n_ranks,
                        "runs": f"{seeds} x 250 steps",
                        "burst_rate": rate,
                        "detector": name,
                        "false_alerts": sum(alerts),
                        "runs_with_an_alert": sum(a > 0 for a in alerts),
                    }
                )
    box = json.loads(REPLAY_2RANKS.read_text())["runs"]
    box_configs = {**configs, "6 slow steps (before)": DetectorConfig(slow_steps=6)}
    false_rows += [replay_row("loaded-box 2-rank runs", 2, box, name, cfg) for name, cfg in box_configs.items()]
    by_pct = {r["straggler_pct"]: r for r in rows}
    summary = {
        "steps_to_alert_20pct": by_pct[20]["worst_steps"],
        "steps_to_alert_20pct_median": by_pct[20]["median_steps"],
        "steps_to_alert_20pct_with_bursts": by_pct[20]["bursts: worst_steps"],
        "steps_to_alert_20pct_first_version": by_pct[20]["first version: median_steps"],
        "false_alerts_loaded_replay": false_rows[0]["false_alerts"],
        "replay_straggler_steps_to_alert": false_rows[0]["straggler_steps_to_alert"],
        "false_alerts_noisy_runs": sum(
            r["false_alerts"] for r in false_rows[2:] if r["detector"] == "default" and r["burst_rate"] == 0.02
        ),
        "false_alerts_noisy_runs_first_version": sum(
            r["false_alerts"] for r in false_rows[2:] if r["detector"] == "first version" and r["burst_rate"] == 0.02
        ),
        "false_alerts_loaded_box_replay": false_rows[-3]["false_alerts"],
        "false_alerts_loaded_box_replay_6_slow_steps": false_rows[-1]["false_alerts"],
        "loaded_box_replay_straggler_steps_to_alert": false_rows[-3]["straggler_steps_to_alert"],
        "noisy_runs": f"{2 * seeds} x 250 steps (4 and 8 ranks, sigma 0.08, 3-5 step bursts at 3-6x, 0.02/rank/step)",
        "straggler_runs": f"{seeds} seeds, {ranks} ranks, sigma 0.05, onset at step {onset}, {horizon} steps watched",
    }
    return rows, false_rows, summary
