"""Paired recompute with overlapped communication (MindSpore 2.7's recomputation_communication_overlap)
against the same recompute without it, on 2 CPU ranks with tensor parallelism (gloo), side by side.

    python benchmarks/bench_recompute.py [--quick] [--out benchmarks/results/recompute.json]
                                         [--plot docs/images/ms-recompute-pair.png]

Each size is a stack of 4 tensor-parallel Llama layers (built by ms_recompute.runtime.tp_model from
an ms_models model), every layer fully recomputed. A step is one backward of the stack (input and
weight gradients) from a fixed input and output gradient. The same model runs the two plans in
alternation, a repetition each: ``sequential`` recomputes each layer alone (compute, all-reduce,
wait, compute); ``paired`` recomputes layers (0, 1) and (2, 3) together so each layer's all-reduce is
in flight while its partner computes. The figure is the recompute part only: the time the runtime
spends inside recomputes, summed over the step, slowest rank; minimum and median over repetitions.
Also reported: the same all-reduce alone, and the time the recomputes spent blocked in ``wait``.
These are the PyNative rows (the hooks: the debug path); the compiled rows (``_recompute_compiled``:
ms_recompute.runtime.CompiledTPStack, one jit graph between collectives) are the training path and
give the summary's headline ratios.
A second table checks memory in fresh processes: what the tape keeps, and the resident set.

On loopback communication is free, so the same comparison runs again (hidden 256) with the two
ranks in network namespaces whose links a tbf qdisc holds to a rate (``ms_layout.comm.netns``;
root only, skipped with the reason otherwise). ``--rate auto`` picks the rate at which one layer's
all-reduce costs ``--share`` (default 0.4) of that layer's recompute measured on loopback, the
seed's setting (communication a third to a half of a layer's compute).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import _recompute_compiled as compiled
import numpy as np
from _common import machine_info, write_result
from _recompute_memory import MEMORY_BATCH, MEMORY_LAYERS, MEMORY_PLANS, MEMORY_SEQ, _memory

from ms_layout.comm import run_local

NPROCS = 2
LAYERS = 4
# (hidden, heads, kv heads, MLP width); batch 4 x 128 tokens
FULL_SIZES = ((128, 4, 2, 256), (256, 4, 2, 512), (512, 8, 4, 1024))
QUICK_SIZES = ((128, 4, 2, 256),)
SHAPED_SIZE = (256, 4, 2, 512)  # the size run again over the shaped link
# compiled rows (ms_recompute.runtime.CompiledTPStack): MLP width 4x hidden; the larger runs shaped too
COMPILED_SIZES = ((256, 4, 2, 1024), (512, 8, 4, 2048))
QUICK_COMPILED_SIZES = ((256, 4, 2, 1024),)
COMPILED_SHAPED_SIZE = (512, 8, 4, 2048)
BATCH, SEQ = 4, 128
MODES = ("sequential", "paired")


def _allreduce_ms(group, n: int, reps: int) -> float:
    buf = np.ones(n, dtype=np.float32)
    times = []
    for _ in range(reps + 1):
        group.barrier()
        start = time.perf_counter()
        group.all_reduce(buf)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:])) * 1e3


def _size(group, size, warm: int, reps: int, keep_trace: bool) -> dict:
    import mindspore as ms

    from ms_recompute import RecomputePlan
    from ms_recompute.runtime import apply_plan

    model, (x, cos, sin, allowed), dout = compiled.tp_stack(size, LAYERS, BATCH, SEQ, group)
    layers = model.model.layers
    weights = [p for layer in layers for p in layer.trainable_params()]

    def block(x):
        for layer in layers:
            x = layer(x, cos, sin, allowed)
        return x

    backward = ms.grad(block, grad_position=0, weights=weights, sens_param=True)
    plans = {m: RecomputePlan.parse(f"0-{LAYERS - 1}=full", LAYERS, overlap=m == "paired", comms=1) for m in MODES}
    measured = {m: [] for m in MODES}  # per repetition: (recompute s, step s, blocked-in-wait s)
    traces = {}
    for rep in range(warm + reps):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:  # alternate which mode goes first
            with apply_plan(model, plans[mode], trace=True) as applied:
                group.barrier()
                start = time.perf_counter()
                dx, _ = backward(x, dout)
                dx.asnumpy()
                step = time.perf_counter() - start
                waits = sum(e.end - e.start for e in applied.events if e.op == "wait")
                if rep >= warm:
                    measured[mode].append((applied.recompute_s, step, waits))
                if keep_trace and rep == warm + reps - 1:
                    traces[mode] = [
                        {
                            "rank": group.rank,
                            "layer": e.layer,
                            "op": e.op,
                            "index": e.index,
                            "start": e.start,
                            "end": e.end,
                        }
                        for e in applied.events
                    ]
    out = {}
    for mode in MODES:
        arr = np.array(measured[mode], dtype=np.float64)
        group.all_reduce(arr, op="max")  # the slowest rank decides a step
        out[mode] = {"median": np.median(arr, axis=0).tolist(), "min": arr.min(axis=0).tolist()}
    out["allreduce_ms"] = _allreduce_ms(group, BATCH * SEQ * size[0], reps=5)
    out["traces"] = traces
    return out


def _bench(group, sizes, compiled_sizes, warm: int, reps: int, trace_size: int) -> dict:
    import mindspore as ms
    from mindspore import device_context

    ms.set_device("CPU")
    device_context.cpu.op_tuning.threads_num(1)  # one compute thread per rank: 2 ranks on 2 cores, gloo beside them
    pynative = [_size(group, size, warm, reps, i == trace_size) for i, size in enumerate(sizes)]
    last = len(compiled_sizes) - 1
    runs = [compiled.measure(group, s, LAYERS, BATCH, SEQ, warm, reps, i == last) for i, s in enumerate(compiled_sizes)]
    allreduce = [_allreduce_ms(group, BATCH * SEQ * s[0], reps=5) for s in compiled_sizes]
    return {"pynative": pynative, "compiled": runs, "compiled_allreduce_ms": allreduce}


def _shaped_rate(rows: list[dict], share: float, hidden: int) -> tuple[str, dict]:
    """The link rate at which one layer's all-reduce takes `share` of its loopback recompute."""
    from ms_layout.comm.netns import rate_for

    row = next(r for r in rows if r["hidden"] == hidden)
    layer_s = row["recompute_ms_sequential"] / 1e3 / LAYERS
    nbytes = BATCH * SEQ * row["hidden"] * 4
    return rate_for(nbytes, share * layer_s), {"layer_recompute_ms": round(layer_s * 1e3, 1), "bytes": nbytes}


def _run_shaped(rate: str, sizes, compiled_sizes, warm: int, reps: int) -> list | str:
    """The TP comparison at the given sizes over links shaped to `rate`, or why it cannot run here."""
    from ms_layout.comm.netns import ShapedNetwork, available

    ok, why = available()
    if not ok:
        return why
    args = (list(sizes), list(compiled_sizes), warm, reps, 0)
    with ShapedNetwork(NPROCS, rate=rate) as net:
        return run_local(_bench, NPROCS, backend="gloo", args=args, timeout=3000, network=net)


def _shaped(kind: str, rows: list[dict], args, size, warm: int, reps: int) -> tuple[dict, list[dict], list]:
    """One shaped-link run of the PyNative or the compiled rows: (link info, rows, every rank's results)."""
    rate, basis = _shaped_rate(rows, args.share, size[0]) if args.rate == "auto" else (args.rate, {})
    info = {"rate": rate, "share_asked": args.share if args.rate == "auto" else None, **basis}
    pynative = kind == "pynative"
    got = _run_shaped(rate, [size] if pynative else [], [] if pynative else [size], warm, reps)
    if isinstance(got, str):
        info["skipped"] = got
        print(f"shaped link: skipped ({got})")
        return info, [], []
    if pynative:
        out = _rows([size], got)
    else:
        out = compiled.rows([size], got[0]["compiled"], LAYERS, BATCH * SEQ, got[0]["compiled_allreduce_ms"])
    _print(out, f"{kind}, over a shaped link ({rate} per direction, network namespaces)")
    return info, out, got


def _rows(sizes, results) -> list[dict]:
    """Per size: the recompute part of a step, sequential vs paired. The machine is shared, so a
    repetition can be slowed by anything else running: the minimum over repetitions is the figure
    least disturbed (timeit's reasoning), the median is shown beside it. ``comm_bound_%`` is the most
    any overlap could save: the recompute's all-reduces, timed alone, over the sequential minimum."""
    rows = []
    for size, r in zip(sizes, results[0]["pynative"]):
        hidden = size[0]
        seq, pair = r["sequential"], r["paired"]
        rows.append(
            {
                **compiled.recompute_columns(hidden, BATCH * SEQ, LAYERS, r["allreduce_ms"], seq, pair),
                "step_ms_sequential": round(seq["min"][1] * 1e3, 1),
                "step_ms_paired": round(pair["min"][1] * 1e3, 1),
            }
        )
    return rows


def _summary(rows, shaped_rows, shaped, compiled_rows, compiled_shaped_rows, compiled_shaped) -> dict:
    """Headline ratios, paired / sequential recompute part: compiled (the training path) at hidden
    512 and PyNative at hidden 256, each on loopback and over its shaped link."""
    plain = next((r for r in rows if r["hidden"] == SHAPED_SIZE[0]), rows[-1])
    cplain = next((r for r in compiled_rows if r["hidden"] == COMPILED_SHAPED_SIZE[0]), compiled_rows[-1])
    out = {
        "paired_over_sequential_plain": cplain["paired/sequential"],
        "backward_paired_over_sequential_plain": cplain["backward paired/sequential"],
        "comm_share_plain_%": cplain["comm_bound_%"],
        "shaped_rate": compiled_shaped.get("rate"),
        "pynative_paired_over_sequential_plain": plain["paired/sequential"],
        "pynative_shaped_rate": shaped.get("rate"),
    }
    if compiled_shaped_rows:
        r = compiled_shaped_rows[0]
        out["paired_over_sequential_shaped"] = r["paired/sequential"]
        out["backward_paired_over_sequential_shaped"] = r["backward paired/sequential"]
        out["comm_share_shaped_%"] = r["comm_bound_%"]
    if shaped_rows:
        out["pynative_paired_over_sequential_shaped"] = shaped_rows[0]["paired/sequential"]
        out["pynative_comm_share_shaped_%"] = shaped_rows[0]["comm_bound_%"]
    return out


def _print(rows: list[dict], title: str) -> None:
    columns = list(rows[0])
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print("  ".join(columns))
        for row in rows:
            print("  ".join(str(row[c]) for c in columns))
        return
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for row in rows:
        table.add_row(*(str(row[c]) for c in columns))
    Console().print(table)


def _first_two_layers(events: list[dict]) -> list[dict]:
    """One rank's steps of the first recomputes its backward ran: one pair, or two layers alone."""
    out, current, layers = [], [], 0
    for e in events:
        if e["op"] != "recompute":
            current.append(e)
            continue
        out, current, layers = out + current, [], layers + e["index"]  # index: layers in that recompute
        if layers >= 2:
            break
    return out


def _plot(trace: dict, path: Path, what: str = "PyNative") -> None:
    """Draw the measured steps of layers 3 and 2, sequential above paired, both ranks."""
    from ms_recompute.draw import draw_timeline

    panels = {}
    captions = {
        "sequential": "each layer alone: 3, then (after layer 3's backward) 2",
        "paired": "paired: 3 and 2 together, each all-reduce under the partner's compute",
    }
    for mode in MODES:
        ranks = sorted({e["rank"] for e in trace[mode]})
        panels[captions[mode]] = [
            e for rank in ranks for e in _first_two_layers([x for x in trace[mode] if x["rank"] == rank])
        ]
    link = f", link {trace['rate']}" if trace.get("rate") else ""
    title = (
        f"{what} recompute of two TP Llama layers on 2 CPU ranks (gloo), hidden {trace['hidden']},"
        f" {BATCH}x{SEQ} tokens{link}: measured timestamps"
    )
    draw_timeline(panels, path, title)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one size, few repetitions (smoke test)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/recompute.json"))
    parser.add_argument(
        "--plot", type=Path, help="also draw the measured timelines of one pair (PNG; -compiled beside)"
    )
    parser.add_argument("--replot", action="store_true", help="only redraw --plot from the trace in --out")
    parser.add_argument("--rate", default="auto", help="shaped link rate (tc units: 50mbit), 'auto', or 'none'")
    parser.add_argument("--share", type=float, default=0.4, help="with --rate auto: all-reduce / layer recompute")
    args = parser.parse_args(argv)
    compiled_plot = args.plot.with_name(f"{args.plot.stem}-compiled{args.plot.suffix}") if args.plot else None
    if args.replot:
        saved = json.loads(args.out.read_text())
        _plot(saved["trace"], args.plot)
        if saved.get("compiled_trace"):
            _plot(saved["compiled_trace"], compiled_plot, "Compiled")
        return 0
    sizes = list(QUICK_SIZES if args.quick else FULL_SIZES)
    compiled_sizes = list(QUICK_COMPILED_SIZES if args.quick else COMPILED_SIZES)
    if args.rate == "auto":
        sizes += [SHAPED_SIZE] if SHAPED_SIZE not in sizes else []
        compiled_sizes += [COMPILED_SHAPED_SIZE] if COMPILED_SHAPED_SIZE not in compiled_sizes else []
    warm, reps = (1, 2) if args.quick else (1, 5)
    trace_size = len(sizes) // 2
    start = time.perf_counter()
    args_local = (sizes, compiled_sizes, warm, reps, trace_size)
    results = run_local(_bench, NPROCS, backend="gloo", args=args_local, timeout=3000)
    rows = _rows(sizes, results)
    title = f"recompute: {LAYERS} TP layers on {NPROCS} CPU ranks, recompute part of a backward (min over reps)"
    _print(rows, "PyNative " + title)
    first = results[0]
    compiled_rows = compiled.rows(
        compiled_sizes, first["compiled"], LAYERS, BATCH * SEQ, first["compiled_allreduce_ms"]
    )
    _print(compiled_rows, "compiled " + title)
    shaped_rows, shaped, compiled_shaped_rows, compiled_shaped, got = [], {"rate": None}, [], {"rate": None}, []
    if args.rate != "none":
        shaped, shaped_rows, _ = _shaped("pynative", rows, args, SHAPED_SIZE, warm, reps)
        compiled_shaped, compiled_shaped_rows, got = _shaped(
            "compiled", compiled_rows, args, COMPILED_SHAPED_SIZE, warm, reps
        )
    memory = [run_local(_memory, 1, backend="gloo", args=(spec,), timeout=1200)[0] for spec in MEMORY_PLANS]
    _print(memory, f"memory: {MEMORY_LAYERS} Llama layers, hidden 256, {MEMORY_BATCH}x{MEMORY_SEQ} tokens, fp32")
    # the compiled pair's timeline: over the shaped link where it ran, else loopback's largest size
    traced = got or results
    result = {
        "benchmark": "recompute",
        "title": f"paired vs sequential full recompute, {LAYERS} TP Llama layers on {NPROCS} CPU ranks (gloo)",
        "machine": machine_info("torch", "mindspore", ranks=NPROCS),
        "quick": args.quick,
        "wall_s": round(time.perf_counter() - start, 1),
        "summary": _summary(rows, shaped_rows, shaped, compiled_rows, compiled_shaped_rows, compiled_shaped),
        "rows": rows,
        "shaped": shaped,
        "shaped_rows": shaped_rows,
        "compiled_rows": compiled_rows,
        "compiled_shaped": compiled_shaped,
        "compiled_shaped_rows": compiled_shaped_rows,
        "compiled_orders": first["compiled"][-1]["orders"],
        "memory_rows": memory,
        "trace": {
            "hidden": sizes[trace_size][0],
            **{m: [e for r in results for e in r["pynative"][trace_size]["traces"][m]] for m in MODES},
        },
        "compiled_trace": {
            "hidden": (COMPILED_SHAPED_SIZE if got else compiled_sizes[-1])[0],
            "rate": compiled_shaped.get("rate") if got else None,
            **{m: [e for r in traced for e in r["compiled"][-1]["traces"][m]] for m in MODES},
        },
    }
    write_result(args.out, result, indent=1)
    if args.plot:
        _plot(result["trace"], args.plot)
        _plot(result["compiled_trace"], compiled_plot, "Compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
