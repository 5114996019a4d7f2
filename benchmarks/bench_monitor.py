"""Overhead of the ms-monitor agent on a 50 ms training step, against the same step without it.

    python benchmarks/bench_monitor.py [--quick] [--detector | --loaded] [--out benchmarks/results/monitor.json]

Two step bodies of about 50 ms: a sleep (a step that waits, as on an accelerator) and numpy work on
one CPU thread (a step that competes with the agent's shipper thread for the CPU and the GIL).
Each step has four ranges (forward, backward, optimizer, and a comm range), as a custom training
loop would. Three configurations run interleaved in blocks, in one process, so drift of a busy
machine hits them alike: no agent; the agent shipping to a live daemon (a separate process, Unix
socket); the agent with no daemon (samples queue up and are dropped). The rows give the median
step time of each and its overhead against no agent. A last row times the monitor calls alone
(empty step and ranges, many iterations): the agent's cost on the training thread per step; the
live rows also give the CPU time the shipper thread and the daemon process spent per step, which
noise on a shared machine does not blur.

A second section (`detector_rows`, `false_alert_rows` and `summary`; alone with `--detector`, which
keeps the overhead rows already in `--out`) measures the slow-rank detector on synthetic busy times
(no timing involved): for a straggler of 5-100 % on 50 ms steps (8 ranks, 5 % noise), the steps from
its onset to the alert, median and worst over seeds, and how many seeds found it in 100 steps, for
the default detector (also with descheduling bursts on every rank, the straggler's included) and for
its first version (3 slow steps and 0.5 s of excess, no windowed test);
and the false alerts on the recorded loaded-host replay
(`packages/ms-monitor/tests/data/loaded_host_busy.json`: alerts before the injected straggler or for
another rank; the same on the real 2-rank runs of the third section recorded in
`tests/data/loaded_box_2ranks.json`, also with the `slow_steps` of before, 6) and on clean noisy
runs with descheduling bursts (a rank at 3-6x its busy time for 3-5 steps, at 0.02 bursts per rank
and step, 1.5x the rate recorded on the loaded 2-core host, and 0.04).

A third section (`loaded_rows`, `loaded_runs`, `loaded_*` summary keys; alone with `--loaded`, which
keeps the rest of `--out`; left out with `--quick`) is real, not replayed: 2 gloo rank processes run
250 steps of ~50 ms numpy work under the deployed agent and CLI daemon while load processes make
the box busy, once clean and once with a 20 % straggler from step 100 (``_monitor_loaded.py``).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one compute thread: the agent's thread competes with it
os.environ.setdefault("OMP_NUM_THREADS", "1")

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import machine_info, print_table, write_result
from _monitor_loaded import loaded_runs, start_daemon

from ms_monitor import Detector, DetectorConfig, Monitor

STEP_S = 0.05
RANGES = (
    ("forward", "phase", 0.35),
    ("backward", "phase", 0.45),
    ("optimizer", "phase", 0.1),
    ("allreduce", "comm", 0.1),
)


def _calibrate_compute(target_s: float) -> int:
    """Matmul repetitions of a 128x128 float32 product that take about target_s on an idle core
    (the fastest of several trials: a busy machine only makes a trial slower)."""
    a = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
    reps = 200
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(reps):
            a @ a
        best = min(best, time.perf_counter() - t)
    return max(1, int(reps * target_s / best))


def make_work(kind: str):
    if kind == "sleep":
        return lambda share: time.sleep(STEP_S * share)
    a = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
    per_step = _calibrate_compute(STEP_S)

    def work(share: float) -> None:
        for _ in range(max(1, int(per_step * share))):
            a @ a

    return work


def run_block(work, mon: Monitor | None, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        if mon is None:
            for _name, _kind, share in RANGES:
                work(share)
        else:
            with mon.step(tokens=4096):
                for name, kind, share in RANGES:
                    with mon.range(name, kind):
                        work(share)
        times.append(time.perf_counter() - t)
    return times


def calls_only(mon: Monitor, iters: int) -> float:
    """Seconds per step spent in the monitor calls themselves (empty step and ranges)."""
    t = time.perf_counter()
    for _ in range(iters):
        with mon.step(tokens=4096):
            for name, kind, _share in RANGES:
                with mon.range(name, kind):
                    pass
    return (time.perf_counter() - t) / iters


def thread_cpu(thread) -> float:
    """CPU seconds used so far by a thread of this process (Linux)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by another process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(kind: str, blocks: int, block_steps: int, sock: str, gone: str, daemon_pid: int) -> tuple[dict, dict]:
    work = make_work(kind)
    live = Monitor(rank=0, addr=f"unix:{sock}")
    dead = Monitor(rank=1, addr=f"unix:{gone}", queue_size=16)
    while not live.stats()["connected"]:
        time.sleep(0.05)
    configs = {"no agent": None, "agent, daemon live": live, "agent, no daemon": dead}
    times: dict[str, list[list[float]]] = {name: [] for name in configs}
    cpu = {"shipper": 0.0, "daemon": 0.0}
    run_block(work, None, 3)  # warm-up
    for b in range(blocks):
        order = list(configs)[b % 3 :] + list(configs)[: b % 3]  # rotate who goes first
        for name in order:
            ship0, daemon0 = thread_cpu(live.shipper._thread), process_cpu(daemon_pid)
            times[name].append(run_block(work, configs[name], block_steps))
            if name == "agent, daemon live":  # CPU the agent's thread and the daemon spent on these steps
                cpu["shipper"] += thread_cpu(live.shipper._thread) - ship0
                cpu["daemon"] += process_cpu(daemon_pid) - daemon0
    sent, dropped = live.stats()["sent"], dead.stats()["dropped"]
    live.close()
    dead.close()
    steps = blocks * block_steps
    print(f"{kind}: live agent sent {sent} samples; the agent without a daemon dropped {dropped}")
    return times, {k: v / steps for k, v in cpu.items()}


def rows_for(kind: str, times: dict[str, list[list[float]]], cpu: dict[str, float]) -> list[dict]:
    """Overhead = median over rounds of (block median with the agent / block median without, same round) - 1:
    pairing the blocks of one round cancels the drift of a busy machine; q25..q75 of those ratios
    show how much the machine's noise moves it."""
    base_blocks = [float(np.median(b)) for b in times["no agent"]]
    rows = []
    for name, blocks in times.items():
        ts = [t for b in blocks for t in b]
        paired = (np.array([float(np.median(b)) / base for b, base in zip(blocks, base_blocks)]) - 1) * 100
        row = {
            "step": f"{kind} {STEP_S * 1e3:.0f} ms",
            "config": name,
            "steps": len(ts),
            "median_ms": round(float(np.median(ts)) * 1e3, 3),
            "overhead_pct": None if name == "no agent" else round(float(np.median(paired)), 3),
            "overhead_q25_q75_pct": None
            if name == "no agent"
            else f"{np.percentile(paired, 25):.2f}..{np.percentile(paired, 75):.2f}",
        }
        if name == "agent, daemon live":
            row["shipper_cpu_us_per_step"] = round(cpu["shipper"] * 1e6, 1)
            row["daemon_cpu_us_per_step"] = round(cpu["daemon"] * 1e6, 1)
        rows.append(row)
    return rows


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
    for name, cfg in configs.items():
        onsets = [replay_onsets(cfg, rec) for rec in runs]
        false_rows.append(
            {
                "data": "loaded-host replay",
                "ranks": 4,
                "runs": f"{len(runs)} x {len(runs[0]['steps'])} steps",
                "burst_rate": "recorded",
                "detector": name,
                "false_alerts": sum(
                    1 for rec, o in zip(runs, onsets) for r, s in o if r != rec["slow_rank"] or s < rec["onset"]
                ),
                "straggler_steps_to_alert": [
                    next((s - rec["onset"] + 1 for r, s in o if r == rec["slow_rank"]), None)
                    for rec, o in zip(runs, onsets)
                ],
            }
        )
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
    for name, cfg in box_configs.items():
        onsets = [replay_onsets(cfg, rec) for rec in box]
        false_rows.append(
            {
                "data": "loaded-box 2-rank runs",
                "ranks": 2,
                "runs": f"{len(box)} x {len(box[0]['steps'])} steps",
                "burst_rate": "recorded",
                "detector": name,
                "false_alerts": sum(
                    1
                    for rec, o in zip(box, onsets)
                    for r, s in o
                    if rec["slow_rank"] is None or r != rec["slow_rank"] or s < rec["onset"]
                ),
                "straggler_steps_to_alert": [
                    next((s - rec["onset"] + 1 for r, s in o if r == rec["slow_rank"] and s >= rec["onset"]), None)
                    for rec, o in zip(box, onsets)
                    if rec["slow_rank"] is not None
                ],
            }
        )
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


def loaded_section() -> dict:
    """The real runs on a loaded box (``_monitor_loaded.py``): rows, runs and summary keys."""
    reps = _calibrate_compute(STEP_S * 0.9)  # before the load starts; the all-reduce adds the rest
    rows, runs, summary = loaded_runs(reps)
    print_table(rows, "monitor: real 2-rank runs on a loaded box (250 steps each), step and busy times per rank")
    print_table(
        [
            {k: v for k, v in r.items() if k not in ("alerts", "steps", "ranks", "step_ms", "busy_ms")}
            | {"alerts": len(r["alerts"])}
            for r in runs
        ],
        "monitor: loaded-box runs, load and alerts",
    )
    for r in runs:
        for a in r["alerts"]:
            print(f"  {r['run']}: rank {a['rank']} {a['kind']} at step {a['step']}: {a['message']}")
    return {"loaded_rows": rows, "loaded_runs": runs, "loaded_summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (smoke test)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/monitor.json"))
    parser.add_argument(
        "--detector", action="store_true", help="only the detector trade-off; keep the overhead rows already in --out"
    )
    parser.add_argument(
        "--loaded", action="store_true", help="only the real runs on a loaded box; keep the rest of --out"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.loaded:
        result = json.loads(args.out.read_text()) if args.out.exists() else {"benchmark": "monitor", "summary": {}}
        result.update(loaded_section())
        result["summary"] = {**result.get("summary", {}), **result.pop("loaded_summary")}
        result["loaded_wall_s"] = round(time.perf_counter() - start, 1)
        write_result(args.out, result)
        return 0
    detector_rows, false_alert_rows, summary = detector_tradeoff(seeds=5 if args.quick else 30)
    print_table(detector_rows, "monitor: slow-rank detector, straggler size vs steps from its onset to the alert")
    print_table(false_alert_rows, "monitor: slow-rank false alerts")
    if args.detector:
        result = json.loads(args.out.read_text()) if args.out.exists() else {"benchmark": "monitor", "rows": []}
        result.update(detector_rows=detector_rows, false_alert_rows=false_alert_rows)
        result["summary"] = {**result.get("summary", {}), **summary}  # the loaded-box keys stay
        result["detector_wall_s"] = round(time.perf_counter() - start, 1)
        write_result(args.out, result)
        return 0
    blocks, block_steps = (4, 10) if args.quick else (40, 6)

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="msmon-bench") as d:
        sock, gone = os.path.join(d, "d.sock"), os.path.join(d, "none.sock")
        daemon = start_daemon(sock)
        try:
            for kind in ("sleep", "numpy"):
                rows += rows_for(kind, *measure(kind, blocks, block_steps, sock, gone, daemon.pid))
            mon = Monitor(rank=2, addr=f"unix:{sock}", queue_size=1 << 20)
            calls_only(mon, 2000)  # warm-up
            per_step = calls_only(mon, 20000 if not args.quick else 5000)
            mon.close()
        finally:
            daemon.terminate()
            daemon.wait(10)
    rows.append(
        {
            "step": "empty (monitor calls only)",
            "config": "agent, daemon live",
            "steps": 20000 if not args.quick else 5000,
            "calls_us_per_step": round(per_step * 1e6, 2),
            "overhead_pct": round(per_step / STEP_S * 100, 4),
        }
    )
    title = "monitor: agent overhead on a 50 ms step (1 step + 4 ranges), interleaved with no agent"
    print_table(rows, title)
    result = {
        "benchmark": "monitor",
        "title": "agent overhead on a 50 ms step vs no agent (same run, interleaved blocks)",
        "machine": machine_info("msgpack", "ms-monitor"),
        "quick": args.quick,
        "wall_s": round(time.perf_counter() - start, 1),
        "rows": rows,
        "detector_rows": detector_rows,
        "false_alert_rows": false_alert_rows,
        "summary": summary,
    }
    if not args.quick:  # last: its load processes must not slow the overhead rows
        result.update(loaded_section())
        result["summary"] = {**summary, **result.pop("loaded_summary")}
        result["wall_s"] = round(time.perf_counter() - start, 1)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
