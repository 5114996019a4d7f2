"""ZeroBubbleV against 1F1B on 2 CPU ranks: measured step time, and the simulator's prediction.

    python benchmarks/bench_pipeline.py [--quick] --out benchmarks/results/pipeline.json

Both schedules train the same toy transformer (ms_pipeline.runtime.toy) on 2 local ranks with one
thread each (gloo moves the tensors), stages compiled with mindspore.jit. For each microbatch
count the script measures, side by side in one run:

* the step time (median over steps, slowest rank);
* the bubble, from the run's own trace (idle over ranks x makespan, and the Zero Bubble authors'
  definition);
* the median F / B / W (ZBV) and F / BW (1F1B) time per stage from the same trace, and the transfer
  latency from a ping-pong of one activation;
* what the simulator predicts for the schedule under exactly those measured costs.

Under jit, B and W each re-run their stage's forward (the generic block-level dx/dw split,
docs/ms-pipeline.md), so ZBV computes more than 1F1B; the benchmark shows how much of that its
smaller bubble wins back, and whether the simulator saw it coming. In PyNative a second table
compares ZBV's two ways to get W (``dw="recompute"`` against ``dw="stored"``, which queues each
linear layer's input and output gradient in B and leaves W two GEMMs per layer) with 1F1B.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from _common import machine_info

RANKS = 2
NAMES = ("1f1b", "zbv")
#: PyNative runs (hooks do not work under jit): (schedule, dw) per row
PYNATIVE = (("1f1b", "auto"), ("zbv", "recompute"), ("zbv", "stored"))
CONFIG = {"vocab": 128, "d": 64, "layers": 3, "heads": 4, "seq": 32, "micro_batch": 4, "jit": True, "threads": 1}


def _label(name, dw):
    return f"{name} pynative" if dw == "auto" else f"{name} pynative dw={dw}"


def _timed(runtimes, inputs, labels, steps, out, m, latency):
    """Timed steps alternating the runtimes, so that all see the same machine (the cores are shared)."""
    for label in runtimes:
        out[label, m] = {"times": [], "events": [], "latency": latency}
    for _ in range(steps):
        for label, runtime in runtimes.items():
            runtime.zero_grads()
            start = time.perf_counter()
            result = runtime.step(inputs, labels)
            out[label, m]["times"].append(time.perf_counter() - start)
            out[label, m]["events"].append(result.events)


def _rank(group, micro_counts, steps, pynative_m):
    """One rank: for each microbatch count, a warm-up step of each schedule, then timed steps
    alternating 1F1B and ZBV; then the PyNative variants at ``pynative_m`` microbatches."""
    import ms_pipeline as mp
    from ms_pipeline.runtime import ToyConfig, setup_cpu, toy_setup

    config = ToyConfig(**CONFIG)
    setup_cpu(config.threads)
    shape = (config.micro_batch, config.seq, config.d)
    latency = _ping_pong(group, shape)
    # one model for both schedules and every microbatch count: each stage is compiled once
    model, _, all_inputs, all_labels = toy_setup(config, 2 * RANKS, max(micro_counts))
    blocks = list(model.blocks)
    out = {}
    for m in micro_counts:
        inputs, labels = all_inputs[:m], all_labels[:m]
        runtimes = {}
        for name in NAMES:
            schedule = mp.build(name, RANKS, m)
            placement = mp.LayerPlacement.even(len(blocks), schedule.num_stages)
            mine = {s: [blocks[i] for i in placement.layers(s)] for s in schedule.stages_of(group.rank)}
            runtimes[name] = mp.runtime.PipelineRuntime(schedule, mine, group, activation_shape=shape, jit=config.jit)
            runtimes[name].step(inputs, labels)  # warm-up: compiles what this schedule needs
        _timed(runtimes, inputs, labels, steps, out, m, latency)
    # PyNative on a model of its own: the jit stages above must never see the dW hooks
    model, _, inputs, labels = toy_setup(ToyConfig(**{**CONFIG, "jit": False}), 2 * RANKS, pynative_m)
    blocks = list(model.blocks)
    runtimes = {}
    for name, dw in PYNATIVE:
        schedule = mp.build(name, RANKS, pynative_m)
        placement = mp.LayerPlacement.even(len(blocks), schedule.num_stages)
        mine = {s: [blocks[i] for i in placement.layers(s)] for s in schedule.stages_of(group.rank)}
        runtime = mp.runtime.PipelineRuntime(schedule, mine, group, activation_shape=shape, dw=dw)
        runtime.step(inputs, labels)  # warm-up (and the one-time check of the stored dW)
        runtimes[_label(name, dw)] = runtime
    _timed(runtimes, inputs, labels, max(2, steps // 2), out, pynative_m, latency)
    return out


def _ping_pong(group, shape, rounds=20):
    """One-way latency of one activation between the two ranks (half the median round trip)."""
    buf = np.zeros(shape, np.float32)
    trips = []
    for _ in range(rounds):
        start = time.perf_counter()
        if group.rank == 0:
            group.send(buf, 1)
            group.recv(buf, 1)
        else:
            group.recv(buf, 0)
            group.send(buf, 0)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2


def _stage_costs(schedule, events):
    """Median duration of F, B, W and BW per stage over the measured steps (the median, since
    the shared cores make single actions stall now and then)."""
    from ms_pipeline import Kind

    sums: dict = {}
    for step_events in events:
        for e in step_events:
            for part in e.action.computes():
                # a pair's halves are not timed apart; none are scheduled here
                key = (part.stage, part.kind)
                sums.setdefault(key, []).append(e.end - e.start)
    mean = {k: statistics.median(v) for k, v in sums.items()}
    f = [mean[(s, Kind.F)] for s in range(schedule.num_stages)]
    if (0, Kind.BW) in mean:
        b = [mean[(s, Kind.BW)] for s in range(schedule.num_stages)]
        w = [0.0] * schedule.num_stages
    else:
        b = [mean[(s, Kind.B)] for s in range(schedule.num_stages)]
        w = [mean[(s, Kind.W)] for s in range(schedule.num_stages)]
    return f, b, w


def _row(name, m, per_rank):
    import ms_pipeline as mp

    schedule = mp.build(name.split()[0], RANKS, m)
    steps = len(per_rank[0]["times"])
    step_times = [max(r["times"][i] for r in per_rank) for i in range(steps)]
    events = [[e for r in per_rank for e in r["events"][i] if e.action.is_compute] for i in range(steps)]
    measured = [mp.Bubbles.of(ev, RANKS) for ev in events]
    f, b, w = _stage_costs(schedule, events)
    latency = per_rank[0]["latency"]
    costs = mp.CostModel(f=f, b=b, w=w, comm=latency, mem_f=1.0, mem_b=-0.5, mem_w=-0.5)
    predicted = mp.simulate(schedule, costs)
    return {
        "schedule": name,
        "microbatches": m,
        "step_s": statistics.median(step_times),
        "step_min_s": min(step_times),
        "trace_makespan_s": statistics.median(x.makespan for x in measured),
        "predicted_makespan_s": predicted.makespan,
        "measured_bubble": statistics.median(x.bubble_rate for x in measured),
        "predicted_bubble": predicted.bubble_rate,
        "measured_bubble_zb": statistics.median(x.bubble_rate_zb for x in measured),
        "predicted_bubble_zb": predicted.bubble_rate_zb,
        "f_ms": 1e3 * statistics.fmean(f),
        "b_ms": 1e3 * statistics.fmean(b),
        "w_ms": 1e3 * statistics.fmean(w),
        "comm_ms": 1e3 * latency,
    }


def _print(rows, title):
    columns = list(rows[0])
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for c in columns:
            table.add_column(c, justify="right")
        for r in rows:
            table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()))
        Console().print(table)
    except ImportError:
        print(title)
        print("  ".join(columns))
        for r in rows:
            print("  ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()))


def _draw(png_dir, trace_dir, results, m: int) -> None:
    """The fastest measured step of each schedule: a PNG (receive waits in grey), a Chrome trace."""
    import ms_pipeline as mp
    from ms_pipeline.draw import draw_png, write_chrome_trace

    for name in NAMES:
        per_rank = [r[name, m] for r in results]
        best = min(range(len(per_rank[0]["times"])), key=lambda i: max(r["times"][i] for r in per_rank))
        events = [e for r in per_rank for e in r["events"][best]]
        t0 = min(e.start for e in events)
        events = [mp.Event(e.rank, e.action, 1e3 * (e.start - t0), 1e3 * (e.end - t0)) for e in events]  # ms
        schedule = mp.build(name, RANKS, m)
        bubbles = mp.Bubbles.of([e for e in events if e.action.is_compute], RANKS)
        title = f"{name}, measured on 2 CPU ranks, m={m}: {bubbles.makespan:.0f} ms, bubble {bubbles.bubble_rate:.1%}"
        if png_dir:
            Path(png_dir).mkdir(parents=True, exist_ok=True)
            path = Path(png_dir) / f"ms-pipeline-run-{name}.png"
            draw_png(events, path, stage_to_rank=schedule.stage_to_rank, title=title, xlabel="ms")
        if trace_dir:
            write_chrome_trace(Path(trace_dir) / f"ms-pipeline-run-{name}.json", events, name=name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer microbatch counts and steps")
    parser.add_argument("--out", default="benchmarks/results/pipeline.json")
    parser.add_argument("--draw", metavar="DIR", help="also write PNG timelines of measured steps here")
    parser.add_argument("--trace", metavar="DIR", help="also write Chrome traces (Perfetto) of measured steps here")
    args = parser.parse_args(argv)
    from ms_layout.comm import run_local

    micro_counts = [4, 8] if args.quick else [4, 8, 12]
    steps = 3 if args.quick else 6
    pynative_m = 8
    start = time.perf_counter()
    results = run_local(
        _rank,
        RANKS,
        backend="gloo",
        args=(micro_counts, steps, pynative_m),
        timeout=1800,
        env={"OMP_NUM_THREADS": "1"},
    )
    print(f"ran in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    rows = []
    for m in micro_counts:
        one = _row("1f1b", m, [r["1f1b", m] for r in results])
        zbv = _row("zbv", m, [r["zbv", m] for r in results])
        for key in ("step_s", "step_min_s", "predicted_makespan_s"):
            zbv[f"zbv/1f1b {key}"] = zbv[key] / one[key]
            one[f"zbv/1f1b {key}"] = 1.0
        rows += [one, zbv]
    base = _row(_label(*PYNATIVE[0]), pynative_m, [r[_label(*PYNATIVE[0]), pynative_m] for r in results])
    pynative = [base]
    for variant in PYNATIVE[1:]:
        row = _row(_label(*variant), pynative_m, [r[_label(*variant), pynative_m] for r in results])
        row["schedule"] = _label(*variant)
        pynative.append(row)
    for row in pynative:
        for key in ("step_s", "step_min_s", "predicted_makespan_s"):
            row[f"zbv/1f1b {key}"] = row[key] / base[key]
    base["schedule"] = _label(*PYNATIVE[0])
    if args.draw or args.trace:
        _draw(args.draw, args.trace, results, micro_counts[len(micro_counts) // 2])
    title = "ZeroBubbleV vs 1F1B, 2 CPU ranks x 1 thread, toy transformer (measured beside simulated)"
    _print(rows, title)
    _print(pynative, f"The same in PyNative, m={pynative_m}: ZBV's W recomputed or from stored linear-layer pairs")
    rows += pynative
    machine = machine_info("mindspore", "torch", ranks=RANKS, threads_per_rank=CONFIG["threads"], model=CONFIG)
    report = {"benchmark": "pipeline", "title": title, "machine": machine, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
