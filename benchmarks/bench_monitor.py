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
keeps the overhead rows already in `--out`; code in _monitor_detector.py) measures the slow-rank
detector on synthetic busy times
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
from _monitor_detector import STEP_S, detector_tradeoff
from _monitor_loaded import loaded_runs, start_daemon

from ms_monitor import Monitor

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
