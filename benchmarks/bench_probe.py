"""ms-probe: dump overhead per training step and compare throughput.

    OMP_NUM_THREADS=1 python benchmarks/bench_probe.py [--quick] [--reps N] [--out benchmarks/results/probe.json]

A small Llama (ms-models on MindSpore PyNative, and Hugging Face transformers on torch with the same
weights) runs forward + backward; each repetition runs the four modes back to back (no dump,
statistics, statistics with async_dump, tensor), so machine noise hits them alike, and the rows give
medians and the ratio to no dump, in wall-clock time and in this process's CPU time (the box is
shared: other processes' load moves the wall-clock ratios more than the CPU-time ones). Then the
tensor dumps of both frameworks are compared (MB of .npy read per second, both sides counted) and so
are the statistics dumps (items per second), report.html included.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import machine_info, write_result

MODES = ("none", "statistics", "statistics-async", "tensor")
"""statistics-async: the statistics task with async_dump (a thread computes them beside the step)."""
SMALL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32)  # fmt: skip


def _folder_mb(path: Path, pattern: str = "*.npy") -> float:
    return sum(p.stat().st_size for p in path.rglob(pattern)) / 2**20


def _steps(model_dir: str, ids: np.ndarray, work: Path, reps: int) -> tuple[list[dict], dict[str, Path]]:
    import mindspore as ms
    import torch
    import transformers

    from ms_models import from_pretrained
    from ms_probe import PrecisionDebugger

    transformers.logging.set_verbosity_error()
    ms_model = from_pretrained(model_dir)
    grad_fn = ms.value_and_grad(lambda x: ms_model(x).mean(), None, ms_model.trainable_params())
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype="float32")
    ms_ids, pt_ids = ms.Tensor(ids), torch.from_numpy(ids).long()

    def ms_step():
        _, grads = grad_fn(ms_ids)
        grads[0].asnumpy()  # PyNative runs asynchronously: wait for the step

    def pt_step():
        hf.zero_grad(set_to_none=True)
        hf(pt_ids, use_cache=False).logits.mean().backward()

    runs = {("mindspore", m): [] for m in MODES} | {("pytorch", m): [] for m in MODES}
    cpu = {k: [] for k in runs}  # this process's CPU time (all its threads): steadier on a shared box
    last_dump: dict[str, Path] = {}
    debuggers = {}
    for fw, model, step in (("mindspore", ms_model, ms_step), ("pytorch", hf, pt_step)):
        step()  # warm-up
        for mode in MODES[1:]:
            task, _, how = mode.partition("-")
            debuggers[(fw, mode)] = PrecisionDebugger(
                dump_path=str(work / f"{fw}_{mode}"), task=task, async_dump=how == "async"
            )
        for _ in range(reps):
            for mode in MODES:
                start, start_cpu = time.perf_counter(), time.process_time()
                if mode == "none":
                    step()
                else:
                    dbg = debuggers[(fw, mode)]
                    with dbg.dump_step(model):
                        step()
                runs[(fw, mode)].append(time.perf_counter() - start)
                cpu[(fw, mode)].append(time.process_time() - start_cpu)
        for mode in MODES[1:]:
            debuggers[(fw, mode)].close()
            last_dump[f"{fw}_{mode}"] = work / f"{fw}_{mode}" / f"step{reps - 1}"
    for fw in ("mindspore", "pytorch"):  # the thread's statistics are the hooks' statistics
        same = [json.loads((last_dump[f"{fw}_{m}"] / "rank0" / "dump.json").read_text())["data"] for m in MODES[1:3]]
        if same[0] != same[1]:
            raise SystemExit(f"{fw}: the async_dump statistics differ from the synchronous ones")
    rows = []
    for fw in ("mindspore", "pytorch"):
        base = statistics.median(runs[(fw, "none")])
        base_cpu = statistics.median(cpu[(fw, "none")])
        for mode in MODES:
            med, med_cpu = statistics.median(runs[(fw, mode)]), statistics.median(cpu[(fw, mode)])
            folder = last_dump.get(f"{fw}_{mode}")
            items = len(json.loads((folder / "rank0" / "dump.json").read_text())["data"]) if folder else 0
            rows.append(
                {
                    "measure": "train step",
                    "framework": fw,
                    "mode": mode,
                    "step_ms": round(med * 1e3, 1),
                    "vs_no_dump": round(med / base, 3),
                    "cpu_ms": round(med_cpu * 1e3, 1),
                    "cpu_vs_no_dump": round(med_cpu / base_cpu, 3),
                    "items": items,
                    "npy_MB": round(_folder_mb(folder), 2) if folder else 0.0,
                }
            )
    return rows, last_dump


def _msprobe_rows(model_dir: str, ids: np.ndarray, work: Path, reps: int) -> list[dict]:
    """msprobe 26.2.0 (mindstudio-probe) dumping statistics of the same MindSpore step, L0,
    alternated with the step without dump; after ms-probe's runs, since msprobe's hooks may
    outlive its stop() (the rows say how the plain step changed). Its Norm uses mint.norm, whose
    LinalgVectorNorm kernel MindSpore 2.10 lacks on CPU: sqrt(sum(x * x)) stands in."""
    try:
        import mindspore as ms
        from mindspore import mint, ops

        norm = mint.norm
        mint.norm = lambda x, *a, **k: ops.sqrt((x.astype(ms.float32) * x.astype(ms.float32)).sum())
        from msprobe.mindspore import PrecisionDebugger as MsprobeDebugger
    except ImportError as e:
        print(f"msprobe peer skipped: {e} (pip install mindstudio-probe)")
        return []
    from ms_models import from_pretrained

    model = from_pretrained(model_dir)
    grad_fn = ms.value_and_grad(lambda x: model(x).mean(), None, model.trainable_params())
    x = ms.Tensor(ids)

    def step():
        grad_fn(x)[1][0].asnumpy()

    config = work / "msprobe_config.json"
    config.write_text(json.dumps({"task": "statistics", "dump_path": str(work / "msprobe"), "level": "L0",
                                  "statistics": {"data_mode": ["all"], "summary_mode": "statistics"}}))  # fmt: skip
    debugger = MsprobeDebugger(config_path=str(config))

    def dumped():
        debugger.start(model)
        step()
        debugger.stop()
        debugger.step()

    before = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        before.append(time.perf_counter() - start)
    times = {"none": [], "msprobe statistics": []}
    try:
        dumped()  # warm-up
        for _ in range(reps):
            for mode, fn in (("none", step), ("msprobe statistics", dumped)):
                start = time.perf_counter()
                fn()
                times[mode].append(time.perf_counter() - start)
    finally:
        mint.norm = norm
    items = max((len(json.loads(f.read_text())["data"]) for f in (work / "msprobe").rglob("dump.json")), default=0)
    base = statistics.median(before)
    rows = []
    for mode, t in (("none before msprobe", before), ("none between msprobe", times["none"]),
                    ("msprobe statistics", times["msprobe statistics"])):  # fmt: skip
        med = statistics.median(t)
        rows.append({"measure": "train step", "framework": "mindspore", "mode": mode, "step_ms": round(med * 1e3, 1),
                     "vs_no_dump": round(med / base, 3), "items": items if mode == "msprobe statistics" else 0,
                     "npy_MB": 0.0})  # fmt: skip
    return rows


def _compare_rows(dumps: dict[str, Path], work: Path, reps: int) -> list[dict]:
    from ms_probe import compare_dirs, load_mapping, write_results

    mapping = load_mapping("ms-models-hf")
    rows = []
    for mode in ("tensor", "statistics"):
        t, g = dumps[f"mindspore_{mode}"], dumps[f"pytorch_{mode}"]
        times, html_times = [], []
        for i in range(reps):
            start = time.perf_counter()
            run = compare_dirs(str(t), str(g), mapping)
            times.append(time.perf_counter() - start)
            start = time.perf_counter()
            write_results(run, work / f"cmp_{mode}_{i}")
            html_times.append(time.perf_counter() - start)
        med = statistics.median(times)
        rc = run.ranks[0]
        mb = _folder_mb(t) + _folder_mb(g)
        rows.append(
            {
                "measure": f"compare ({mode})",
                "aligned_items": rc.summary()["aligned_items"],
                "rows": len(rc.rows),
                "npy_MB_read": round(mb, 2),
                "compare_s": round(med, 3),
                "MB_per_s": round(mb / med, 1) if mb else None,
                "items_per_s": round(rc.summary()["aligned_items"] / med, 1),
                "write_csv_json_html_s": round(statistics.median(html_times), 3),
                "first_divergence": rc.first_divergence,
            }
        )
    return rows


def _print(rows: list[dict], title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for row in rows:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
        return
    for measure in dict.fromkeys(r["measure"].split(" (")[0] for r in rows):
        part = [r for r in rows if r["measure"].startswith(measure)]
        table = Table(title=f"{title}: {measure}")
        columns = list(dict.fromkeys(k for r in part for k in r))
        for c in columns:
            table.add_column(c, justify="right")
        for r in part:
            table.add_row(*(str(r.get(c, "")) for c in columns))
        Console().print(table)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 repetitions")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of each mode (default 7, 3 with --quick)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/probe.json"))
    args = ap.parse_args()

    import mindspore as ms

    from ms_models import make_tiny

    ms.set_device("CPU")
    # PyNative on CPU without it runs ~9x slower here (measured 1220 ms against 132 a step): the
    # step timed without dump would be MindSpore's asynchronous dispatch, not the model
    ms.set_context(pynative_synchronize=True)
    reps = args.reps or (3 if args.quick else 7)
    batch, seq = (2, 16) if args.quick else (4, 64)
    work = Path(tempfile.mkdtemp(prefix="bench_probe_"))
    load_before = os.getloadavg()[0]  # other processes on a shared box slow every mode alike
    start = time.perf_counter()
    try:
        overrides = {} if args.quick else SMALL
        model_dir = make_tiny("llama", work / "model", seed=0, **overrides)
        ids = np.random.default_rng(0).integers(4, 300, (batch, seq)).astype(np.int32)
        rows, dumps = _steps(model_dir, ids, work, reps)
        rows += _msprobe_rows(model_dir, ids, work, reps)
        rows += _compare_rows(dumps, work, max(3, reps // 2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    config = "tiny llama" if args.quick else "llama hidden 256, 4 layers, MLP 688"
    title = f"probe: dump overhead per train step and compare throughput ({config}, batch {batch} x seq {seq})"
    _print(rows, title)
    by = {(r["framework"], r["mode"]): r for r in rows if r["measure"] == "train step"}
    summary = {
        f"{'ms' if fw == 'mindspore' else 'torch'}_{mode.replace('-', '_')}_over_no_dump": by[(fw, mode)]["vs_no_dump"]
        for fw in ("mindspore", "pytorch")
        for mode in MODES[1:]
    }
    summary |= {
        f"{'ms' if fw == 'mindspore' else 'torch'}_{mode.replace('-', '_')}_cpu_over_no_dump": by[(fw, mode)][
            "cpu_vs_no_dump"
        ]
        for fw in ("mindspore", "pytorch")
        for mode in MODES[1:]
    }
    peer = by.get(("mindspore", "msprobe statistics"))
    if peer is not None:  # the peer's own statistics dump of the same step, measured in the same run
        summary["msprobe_statistics_over_no_dump"] = peer["vs_no_dump"]
    summary["load_avg_1m_before"] = round(load_before, 2)
    summary["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    summary["reps"] = reps
    result = {
        "benchmark": "probe",
        "title": title,
        "summary": summary,
        "machine": machine_info("mindspore", "torch", "transformers", load_avg_1m_before=round(load_before, 2)),
        "quick": args.quick,
        "wall_s": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
