"""A real run on a loaded box: 2 gloo ranks, 250 steps of ~50 ms numpy work, the deployed daemon.

    python benchmarks/bench_monitor.py --loaded      (this section alone; keeps the rest of --out)
    python benchmarks/_monitor_loaded.py --load-worker SEED SECONDS   (one load process, internal)

Not a replay: the ranks are processes started by ``ms_layout.comm.run_local`` (gloo), each with a
``Monitor`` shipping to an ``ms-monitor daemon`` process started from the CLI with its default
detector (as users run it), over a Unix socket; the daemon writes its alerts to a JSON-lines file
(``--jsonl``), which is what is counted. Each step is a training-like step: forward, backward and
optimizer ranges of 128x128 float32 matmuls on one BLAS thread (the same number on every rank,
calibrated on this box before the load starts, ~45 ms idle), then an all-reduce of a 256 KiB
gradient in a ``comm`` range.

The box is loaded by ``LOADERS`` extra processes, each alternating idle gaps (exponential, mean 0.3
s) with bursts of 0.2-1.5 s of CPU work (matmuls) or memory traffic (copies of a 64 MiB array),
chosen at random, from a few seconds before the first run to the end of the last; other sessions'
tests on the same box add to it. The load is recorded three ways: the 1-minute load average at the
end of each run, and the mean and maximum of the instantaneous run queue (``procs_running`` of
/proc/stat, minus the sampler itself) sampled every 0.1 s during the run.

Two runs, each with a fresh daemon: a clean one (no straggler: every alert is false), and one with a
20 % straggler (rank 1 does 1.2x the matmuls from step 100 on), whose steps to alert are counted
from step 100 (the onset step counts as 1). Each run keeps the step and busy times the daemon received
(``steps``, ``step_ms``, ``busy_ms`` in ``loaded_runs``), in the form of the test data
``packages/ms-monitor/tests/data/loaded_box_2ranks.json`` (two such sittings), so the detector can be
replayed on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

LOADERS = 3
STEPS = 250
ONSET = 100
STRAGGLER = 0.2
NRANKS = 2
#: compute ranges and their share of the step's matmuls (the comm range is the all-reduce)
PHASES = (("forward", 0.4), ("backward", 0.45), ("optimizer", 0.15))


def load_worker(seed: int, seconds: float) -> None:
    """Bursty CPU work and memory traffic at random intervals for `seconds` (a load process)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((128, 128)).astype(np.float32)
    big = np.ones(16 << 20, dtype=np.float32)  # 64 MiB: copies go through memory, not the caches
    out = np.empty_like(big)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(rng.exponential(0.3), max(0.0, end - time.monotonic())))
        burst_end = time.monotonic() + rng.uniform(0.2, 1.5)
        memory = rng.random() < 0.5
        while time.monotonic() < min(burst_end, end):
            if memory:
                np.copyto(out, big)
            else:
                for _ in range(20):
                    a @ a


def rank_main(group, addr: str, steps: int, reps: int, straggler: tuple[int, int, float] | None) -> dict:
    """One rank: `steps` monitored steps of `reps` matmuls (x (1 + extra) on the straggler from its
    onset) and an all-reduce; returns its own step and busy times."""
    from ms_monitor import Monitor

    mon = Monitor(rank=group.rank, world_size=group.size, addr=addr, tokens_per_step=4096)
    while not mon.stats()["connected"]:
        time.sleep(0.02)
    a = np.random.default_rng(group.rank).standard_normal((128, 128)).astype(np.float32)
    grad = np.ones(1 << 16, dtype=np.float32)
    step_s, busy_s = [], []
    for step in range(1, steps + 1):
        n = reps
        if straggler is not None and group.rank == straggler[0] and step >= straggler[1]:
            n = round(reps * (1 + straggler[2]))
        t0 = time.perf_counter()
        with mon.step():
            for name, share in PHASES:
                with mon.range(name):
                    for _ in range(max(1, int(n * share))):
                        a @ a
            t1 = time.perf_counter()
            with mon.range("allreduce", kind="comm"):
                group.all_reduce(grad)
        step_s.append(time.perf_counter() - t0)
        busy_s.append(t1 - t0)
    stats = mon.stats()
    mon.close()
    return {"step_s": step_s, "busy_s": busy_s, "sent": stats["sent"], "dropped": stats["dropped"]}


class RunQueue:
    """Samples /proc/stat's procs_running every 0.1 s in a thread (minus the sampler itself)."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                text = Path("/proc/stat").read_text()
            except OSError:
                return
            for line in text.splitlines():
                if line.startswith("procs_running "):
                    self.samples.append(int(line.split()[1]) - 1)

    def __enter__(self) -> RunQueue:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(2)


def start_daemon(sock: str, jsonl: str | None = None) -> subprocess.Popen:
    """The daemon as users start it (CLI, default detector), listening on a Unix socket; its
    alerts also go to ``jsonl`` when given."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ms_monitor", "daemon", "--port", "-1", "--http-port", "-1", "--unix", sock]
        + (["--jsonl", jsonl] if jsonl else []),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not os.path.exists(sock):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the ms-monitor daemon did not start")
        time.sleep(0.05)
    return proc


def window_margin(samples: list[dict], window: int = 15, ratio: float = 1.07, first: int = 4) -> dict[int, dict]:
    """From the samples the daemon received: per rank, the median of its busy time over its peers'
    median, and the largest share of any `window` consecutive steps at `ratio` x or more (the
    default windowed test raises at 13/15 = 0.87 with steady ratios: how close a clean run came),
    over the steps from `first` on (the detector skips 3 warm-up steps)."""
    busy: dict[int, dict[int, float]] = {}
    for s in samples:
        busy.setdefault(s["s"], {})[s["r"]] = max(s["dt"] - s.get("ct", 0.0), 0.0)
    steps = sorted(k for k, v in busy.items() if k >= first and len(v) >= 2)
    out = {}
    for rank in sorted({r for v in busy.values() for r in v}):
        ratios = []
        for k in steps:
            peers = [t for r, t in busy[k].items() if r != rank]
            if rank in busy[k] and np.median(peers) > 0:
                ratios.append(busy[k][rank] / float(np.median(peers)))
        high = np.array(ratios) >= ratio
        shares = np.convolve(high, np.ones(window), "valid") / window if len(high) >= window else [0.0]
        out[rank] = {
            "ratio_p50": round(float(np.median(ratios)), 3),
            "share": round(float(high.mean()), 2),
            "max_window_share": round(float(max(shares)), 2),
        }
    return out


def recorded(samples: list[dict], nranks: int) -> dict:
    """The samples as the replay file's runs hold them: steps, ranks, step_ms and busy_ms per rank."""
    by = {(s["r"], s["s"]): s for s in samples}
    steps = sorted({s["s"] for s in samples})
    cell = {r: [by.get((r, k)) for k in steps] for r in range(nranks)}
    return {
        "steps": steps,
        "ranks": list(range(nranks)),
        "step_ms": [[None if s is None else round(s["dt"] * 1e3, 2) for s in cell[r]] for r in range(nranks)],
        "busy_ms": [
            [None if s is None else round(max(s["dt"] - s.get("ct", 0.0), 0.0) * 1e3, 2) for s in cell[r]]
            for r in range(nranks)
        ],
    }


def one_run(tmp: str, name: str, reps: int, straggler: tuple[int, int, float] | None) -> tuple[list[dict], dict]:
    """One monitored run under the load already running; per-rank rows and the run's summary."""
    from ms_layout.comm import run_local

    sock, jsonl = os.path.join(tmp, f"{name}.sock"), os.path.join(tmp, f"{name}.jsonl")
    daemon = start_daemon(sock, jsonl)
    t0 = time.perf_counter()
    try:
        with RunQueue() as rq:
            env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
            results = run_local(rank_main, NRANKS, args=(f"unix:{sock}", STEPS, reps, straggler), env=env, timeout=600)
        time.sleep(1.0)  # the last batches reach the daemon
    finally:
        daemon.terminate()  # SIGTERM: the daemon closes (flushes) its JSON-lines file
        daemon.wait(15)
    wall = time.perf_counter() - t0
    load_1m = os.getloadavg()[0]
    records = [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()]
    raised = [r for r in records if r["type"] == "alert" and r["event"] == "raised"]
    samples = [r for r in records if r["type"] == "sample"]
    margin = window_margin(samples)
    rows = []
    for rank, res in enumerate(results):
        st, bu = np.array(res["step_s"]) * 1e3, np.array(res["busy_s"]) * 1e3
        rows.append(
            {
                "run": name,
                "rank": rank,
                "steps": len(st),
                "step_p50_ms": round(float(np.median(st)), 1),
                "step_p95_ms": round(float(np.percentile(st, 95)), 1),
                "step_max_ms": round(float(st.max()), 1),
                "busy_p50_ms": round(float(np.median(bu)), 1),
                "busy_p95_ms": round(float(np.percentile(bu, 95)), 1),
                "busy_max_ms": round(float(bu.max()), 1),
                "busy_ratio_p50": margin[rank]["ratio_p50"],
                "max_share_15": margin[rank]["max_window_share"],
                "alerts": sum(1 for a in raised if a["rank"] == rank),
                "dropped": res["dropped"],
            }
        )
    run = {
        "run": name,
        "wall_s": round(wall, 1),
        "samples_at_daemon": len(samples),
        "alerts": [{k: a[k] for k in ("rank", "kind", "step", "message")} for a in raised],
        "alerts_by_kind": {k: sum(1 for a in raised if a["kind"] == k) for k in ("slow_rank", "regression", "jitter")},
        "load_avg_1m_end": round(load_1m, 2),
        "run_queue_mean": round(float(np.mean(rq.samples)), 2) if rq.samples else None,
        "run_queue_max": max(rq.samples) if rq.samples else None,
        # what the daemon received, per rank and step (ms), to replay the detector on (as test data)
        **recorded(samples, len(results)),
    }
    if straggler is not None:
        hits = [a["step"] for a in raised if a["rank"] == straggler[0] and a["kind"] == "slow_rank"]
        hits = [s for s in hits if s >= straggler[1]]
        run["straggler_steps_to_alert"] = hits[0] - straggler[1] + 1 if hits else None
        after = window_margin(samples, first=straggler[1])[straggler[0]]
        run["straggler_busy_ratio_p50"] = after["ratio_p50"]  # from its onset on
        run["straggler_share_at_1.07"] = after["share"]
        slow = [a for a in raised if a["kind"] == "slow_rank"]
        run["false_slow_rank_alerts"] = sum(1 for a in slow if a["rank"] != straggler[0] or a["step"] < straggler[1])
        run["straggler_raised"] = len(slow) - run["false_slow_rank_alerts"]  # > 1: resolved and raised again
    return rows, run


def loaded_runs(reps: int, warm_s: float = 8.0) -> tuple[list[dict], list[dict], dict]:
    """The clean run and the straggler run under one load; (rows, runs, summary keys)."""
    with tempfile.TemporaryDirectory(prefix="msmon-loaded") as tmp:
        loaders = [
            subprocess.Popen(
                [sys.executable, __file__, "--load-worker", str(seed), "600"],
                env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
            )
            for seed in range(LOADERS)
        ]
        try:
            time.sleep(warm_s)  # the load is on before the first step
            clean_rows, clean = one_run(tmp, "clean", reps, None)
            strag_rows, strag = one_run(tmp, "straggler 20% rank 1 from step 100", reps, (1, ONSET, STRAGGLER))
        finally:
            for p in loaders:
                p.terminate()
            for p in loaders:
                p.wait(10)
    summary = {
        "loaded_clean_alerts": len(clean["alerts"]),
        "loaded_clean_steps": STEPS,
        "loaded_load_avg": clean["load_avg_1m_end"],
        "loaded_run_queue_mean": clean["run_queue_mean"],
        "loaded_clean_step_p50_p95_max_ms": [
            [r["step_p50_ms"], r["step_p95_ms"], r["step_max_ms"]] for r in clean_rows
        ],
        "loaded_straggler_steps_to_alert": strag["straggler_steps_to_alert"],
        "loaded_straggler_false_slow_rank_alerts": strag["false_slow_rank_alerts"],
        "loaded_straggler_alerts_by_kind": strag["alerts_by_kind"],
        "loaded_setup": (
            f"{NRANKS} gloo ranks, {STEPS} steps of {reps} 128x128 matmuls + 256 KiB all-reduce, CLI daemon"
            f" with the default detector, {LOADERS} bursty CPU/memory load processes, {os.cpu_count()} cores"
        ),
    }
    return clean_rows + strag_rows, [clean, strag], summary


if __name__ == "__main__" and sys.argv[1:2] == ["--load-worker"]:
    load_worker(int(sys.argv[2]), float(sys.argv[3]))
