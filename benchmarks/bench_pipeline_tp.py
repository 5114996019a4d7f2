"""ZeroBubbleV's 1B1F pairs interleaved at the tensor-parallel all-reduces, against the same pairs
run as their halves, on loopback and over a shaped link; the simulator with the overlap it measured.

    python benchmarks/bench_pipeline_tp.py [--hidden 512 --layers 4 --seq 128 --micro-batch 4
        --microbatches 8] [--quick] --out benchmarks/results/pipeline_tp.json

Two gloo ranks x 1 thread (rank r pinned to CPU r) form one TP group of 2 holding a whole
ZeroBubbleV pipeline of one rank: its V's two chunks are local, so every 1B1F pair is an F of one
chunk and a B of the other, and the only communication is the TP all-reduces inside the layers
(two per layer and pass). Each chunk's layers are one ms-recompute ``TPStackBlock`` (compiled
segments between the all-reduces, no recompute), chained by ms-pipeline's stage between the
compiled embedding and head. Variants alternate round by round:

* ``zbv``: ZeroBubbleV without pairs;
* ``zbv+1b1f halves``: the pairs run as their halves, one after the other (the runtime's default);
* ``zbv+1b1f interleaved``: ``overlap_fn=interleave_layers``, the halves alternating at every
  all-reduce, each one's collective in flight while the other computes.

The overlap a pair achieved is measured: o = (F + B - D) / min(F, B) with F and B the halves'
mean times in the halves run and D the interleaved pair's; the simulator, given o
(``CostModel.overlap``) and the halves' costs, predicts the interleaved step. Over the shaped link
(``--rate auto``: one all-reduce of an activation takes ``--share`` of a layer's forward) the
same variants run again. The JSON's ``summary`` holds ``interleaved_over_halves`` and
``interleaved_over_halves_shaped`` with the simulator's predictions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from _common import machine_info, print_table, write_result

VARIANTS = ("zbv", "zbv+1b1f halves", "zbv+1b1f interleaved")


def _schedule(name: str, m: int):
    import ms_pipeline as mp

    return mp.build("zbv", 1, m, **({"overlap": True} if "1b1f" in name else {}))


def _rank(group, args):
    import mindspore as ms

    import ms_models
    import ms_pipeline as mp
    from ms_pipeline.runtime import setup_cpu
    from ms_recompute.runtime import tp_model, tp_stage_blocks

    setup_cpu(1)
    config = ms_models.tiny_config(
        "llama", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(2.6875 * args.hidden),
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
        head_dim=args.hidden // args.heads, max_position_embeddings=max(256, args.seq), tie_word_embeddings=False,
    )  # fmt: skip
    net, _ = tp_model(ms_models.from_config(config, seed=0), group)
    pp = group.split([[r] for r in range(group.size)])  # one pipeline rank per TP rank
    rng = np.random.default_rng(1)
    ids = rng.integers(0, args.vocab, (args.microbatches, args.micro_batch, args.seq + 1)).astype(np.int32)
    inputs, labels = [ms.Tensor(x[:, :-1]) for x in ids], [ms.Tensor(x[:, 1:]) for x in ids]
    half = args.layers // 2
    stages = tp_stage_blocks(net, [half, args.layers - half], group, recompute=False)
    shape = (args.micro_batch, args.seq, args.hidden)
    runtimes = {}
    for name in VARIANTS:
        fn = mp.runtime.interleave_layers if name.endswith("interleaved") else None
        schedule = _schedule(name, args.microbatches)
        runtimes[name] = mp.runtime.PipelineRuntime(
            schedule, {0: stages[0], 1: stages[1]}, pp, activation_shape=shape, jit=True, overlap_fn=fn
        )
        runtimes[name].step(inputs, labels)  # compiles
    out = {name: {"times": [], "events": [], "interleaved": []} for name in VARIANTS}
    for _ in range(args.steps):
        for name in VARIANTS:
            group.barrier()
            start = time.perf_counter()
            runtimes[name].zero_grads()
            result = runtimes[name].step(inputs, labels)
            out[name]["times"].append(time.perf_counter() - start)
            out[name]["events"].append(result.events)
            out[name]["interleaved"] = [list(steps) for _, steps in result.interleaved]
    return out


def _row(name, args, per_rank, halves_costs=None):
    import ms_pipeline as mp

    steps = len(per_rank[0][name]["times"])
    times = [max(r[name]["times"][i] for r in per_rank) for i in range(steps)]
    events = [e for r in per_rank[:1] for step in r[name]["events"] for e in step if e.action.is_compute]
    row = {"variant": name, "step_s": statistics.median(times), "step_times_s": times}
    mean = mp.mean_durations(events)
    schedule = _schedule(name, args.microbatches)
    if name.endswith("interleaved"):
        f, b, w = halves_costs
        pairs = [e for e in events if e.action.parts is not None]
        overlap = statistics.fmean(
            (f[p.stage] + b[q.stage] - (e.end - e.start)) / min(f[p.stage], b[q.stage])
            for e in pairs
            for p, q in [e.action.parts]
        )
        row["measured_overlap"] = overlap
        costs = mp.CostModel(f=f, b=b, w=w, overlap=min(1.0, max(0.0, overlap)))
        row["predicted_s"] = mp.simulate(schedule, costs).makespan
    else:
        f = [mean[(s, mp.Kind.F)] for s in range(2)]
        b = [mean[(s, mp.Kind.B)] for s in range(2)]
        w = [mean[(s, mp.Kind.W)] for s in range(2)]
        row.update(f_ms=1e3 * statistics.fmean(f), b_ms=1e3 * statistics.fmean(b), w_ms=1e3 * statistics.fmean(w))
        row["predicted_s"] = mp.simulate(mp.split_pairs(schedule), mp.CostModel(f=f, b=b, w=w)).makespan
        halves_costs = (f, b, w)
    row["simulator_error"] = abs(row["predicted_s"] - row["step_s"]) / row["step_s"]
    return row, halves_costs


def _rows(args, per_rank):
    rows, costs = [], None
    for name in VARIANTS:
        row, costs = _row(name, args, per_rank, costs if name.endswith("interleaved") else None)
        rows.append(row)
    by = {r["variant"]: r for r in rows}
    for r in rows:
        r["/ halves"] = r["step_s"] / by["zbv+1b1f halves"]["step_s"]
        paired = [a / b for a, b in zip(r["step_times_s"], by["zbv+1b1f halves"]["step_times_s"])]
        r["/ halves, per round"] = statistics.median(paired)
    return rows, by


def _run(args, network=None):
    from ms_layout.comm import run_local

    return run_local(
        _rank, 2, backend="gloo", args=(args,), timeout=3000, env={"OMP_NUM_THREADS": "1"},
        network=network, pin_cpus=True,
    )  # fmt: skip


def _summary_of(by, suffix):
    inter, halves = by["zbv+1b1f interleaved"], by["zbv+1b1f halves"]
    return {
        f"interleaved_over_halves{suffix}": inter["step_s"] / halves["step_s"],
        f"interleaved_over_halves_per_round{suffix}": inter["/ halves, per round"],
        f"interleaved_over_halves_predicted{suffix}": inter["predicted_s"] / halves["predicted_s"],
        f"measured_overlap{suffix}": inter["measured_overlap"],
        f"simulator_error{suffix}": max(r["simulator_error"] for r in by.values()),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers, half per chunk (default 4)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sample (default 128)")
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per microbatch (default 4)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary (default 2048)")
    parser.add_argument("--steps", type=int, default=0, help="timed rounds (default 6, 3 with --quick)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--rate", default="auto", help="shaped link rate (tc units: 200mbit), 'auto', or 'none'")
    parser.add_argument(
        "--share", type=float, default=0.3, help="with --rate auto: one all-reduce / a layer's F (2 a layer)"
    )
    parser.add_argument("--out", default="benchmarks/results/pipeline_tp.json")
    args = parser.parse_args(argv)
    args.steps = args.steps or (3 if args.quick else 6)
    for flag in ("hidden", "layers", "heads", "seq", "micro_batch", "microbatches", "vocab", "steps"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.layers < 2 or args.hidden % args.heads or args.heads % 4:
        parser.error(f"--layers {args.layers} >= 2 and --heads {args.heads} (a multiple of 4) dividing --hidden")
    if not 0 < args.share < 10:
        parser.error(f"--share must be within (0, 10), got {args.share}")
    from ms_layout.comm.netns import ShapedNetwork, available, rate_for

    start = time.perf_counter()
    rows, by = _rows(args, _run(args))
    summary = _summary_of(by, "")
    shaped, shaped_rows = {"rate": None}, []
    ok, why = available()
    if args.rate != "none" and not ok:
        shaped["skipped"] = why
        print(f"shaped-link run skipped: {why}", file=sys.stderr)
    elif args.rate != "none":
        layer_f = 1e-3 * by["zbv"]["f_ms"] / (args.layers / 2)  # a chunk's F over its layers
        nbytes = args.micro_batch * args.seq * args.hidden * 4
        rate = rate_for(nbytes, args.share * layer_f) if args.rate == "auto" else args.rate
        with ShapedNetwork(2, rate=rate) as net:
            shaped_rows, sby = _rows(args, _run(args, net))
        shaped = {"rate": rate, "share_asked": args.share if args.rate == "auto" else None, "bytes": nbytes}
        summary.update(_summary_of(sby, "_shaped"))
        # what the link adds to a forward (4 all-reduces a chunk), as a share of its loopback time
        summary["comm_share_shaped"] = sby["zbv"]["f_ms"] / by["zbv"]["f_ms"] - 1.0
    print(f"ran in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    title = (
        f"ZeroBubbleV 1B1F pairs interleaved at the TP all-reduces vs run as halves: 1 pipeline rank x TP 2, "
        f"Llama d={args.hidden} x {args.layers} layers, seq {args.seq}, micro-batch {args.micro_batch}, "
        f"m={args.microbatches}"
    )

    def printable(r):
        return {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in r.items() if not isinstance(v, list)}

    print_table([printable(r) for r in rows], title + ", loopback")
    if shaped_rows:
        print_table([printable(r) for r in shaped_rows], f"the same over a shaped link ({shaped['rate']})")
    model = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "seq", "micro_batch", "microbatches", "vocab")}
    machine = machine_info("mindspore", ranks=2, threads_per_rank=1, model=model, pinned=True)
    summary["load_avg_1m"] = machine["load_avg_1m"]
    report = {
        "benchmark": "pipeline_tp",
        "title": title,
        "summary": summary,
        "machine": machine,
        "rows": rows,
        "shaped": shaped,
        "shaped_rows": shaped_rows,
    }
    print(json.dumps(summary, indent=2))
    write_result(Path(args.out), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
