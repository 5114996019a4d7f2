"""Collective bandwidth of ms_layout.comm on 2 local CPU ranks: gloo against MindSpore's own CPU
backend (mccl, through our mindspore backend), side by side in the same run.

    python benchmarks/bench_comm.py [--quick] [--out benchmarks/results/comm.json]

Each size gets a few warm-up calls, then timed repetitions; a repetition's time is the slowest
rank's (each starts after a barrier) and the row reports the median. Bus bandwidth follows the
NCCL-tests convention: algbw * 2(n-1)/n for all_reduce and algbw * (n-1)/n for all_to_all.
mccl has no all_to_all, so that row has no MindSpore figure.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from _common import machine_info, package_version, print_table, write_result

from ms_layout.comm import CommUnsupportedError, run_local

NPROCS = 2
MB = 1 << 20
FULL_SIZES_MB = (1, 4, 16, 64)
QUICK_SIZES_MB = (1, 4)


def _reps(size_mb: int, backend: str) -> tuple[int, int]:
    """(warm-up, timed) repetitions; MindSpore's CPU all_reduce is slow (~35 ms per 4 MB)."""
    if backend == "mindspore":
        return (1, 3) if size_mb >= 16 else (2, 5)
    return (2, 5) if size_mb >= 16 else (3, 10)


def _measure(group, op: str, sizes_mb: list[int]) -> dict[int, list[float]]:
    """Runs on every rank: {size_mb: [seconds per repetition, slowest rank]}."""
    out: dict[int, list[float]] = {}
    for size_mb in sizes_mb:
        x = np.full(size_mb * MB // 4, 1e-3, dtype=np.float32)
        warm, reps = _reps(size_mb, group.backend)
        times = np.zeros(reps, dtype=np.float32)
        for i in range(warm + reps):
            group.barrier()
            start = time.perf_counter()
            if op == "all_reduce":
                group.all_reduce(x)
            else:
                group.all_to_all(x)
            if i >= warm:
                times[i - warm] = time.perf_counter() - start
        group.all_reduce(times, op="max")
        out[size_mb] = [float(t) for t in times]
    return out


def _bench(group, sizes_mb: list[int]) -> dict[str, dict[int, list[float]] | None]:
    results: dict[str, dict[int, list[float]] | None] = {}
    for op in ("all_reduce", "all_to_all"):
        try:
            results[op] = _measure(group, op, sizes_mb)
        except CommUnsupportedError:  # mccl: all_to_all (refused before anything is sent)
            results[op] = None
    return results


def _busbw(op: str, nbytes: int, seconds: float, n: int = NPROCS) -> float:
    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    return nbytes / seconds * factor / 1e9


def _rows(gloo: dict, ms: dict | None, sizes_mb: list[int]) -> list[dict]:
    rows = []
    for op in ("all_reduce", "all_to_all"):
        for size_mb in sizes_mb:
            g_ms = float(np.median(gloo[op][size_mb])) * 1e3
            row = {
                "op": op,
                "size_MB": size_mb,
                "gloo_ms": round(g_ms, 3),
                "gloo_busbw_GBps": round(_busbw(op, size_mb * MB, g_ms / 1e3), 3),
                "mindspore_ms": None,
                "mindspore_busbw_GBps": None,
                "mindspore/gloo": None,
            }
            times = (ms or {}).get(op)
            if times:
                m_ms = float(np.median(times[size_mb])) * 1e3
                row["mindspore_ms"] = round(m_ms, 3)
                row["mindspore_busbw_GBps"] = round(_busbw(op, size_mb * MB, m_ms / 1e3), 3)
                row["mindspore/gloo"] = round(m_ms / g_ms, 2)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 and 4 MB only (smoke test)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/comm.json"))
    parser.add_argument("--no-mindspore", action="store_true", help="gloo only")
    args = parser.parse_args(argv)
    sizes = list(QUICK_SIZES_MB if args.quick else FULL_SIZES_MB)

    start = time.perf_counter()
    gloo = run_local(_bench, NPROCS, backend="gloo", args=(sizes,), timeout=300)[0]
    ms = None
    if not args.no_mindspore and package_version("mindspore"):
        ms = run_local(_bench, NPROCS, backend="mindspore", args=(sizes,), timeout=300)[0]
    rows = _rows(gloo, ms, sizes)
    title = f"comm: {NPROCS} local CPU ranks, float32, median time and bus bandwidth"
    print_table(rows, title)
    result = {
        "benchmark": "comm",
        "title": f"{NPROCS} local CPU ranks, float32: gloo vs MindSpore mccl",
        "machine": machine_info("torch", "mindspore", ranks=NPROCS),
        "quick": args.quick,
        "wall_s": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
