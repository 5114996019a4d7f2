"""ZeroBubbleV against 1F1B on 2 CPU ranks, ms-pipeline beside PyTorch's own pipelining, with the
simulator's prediction from the measured costs.

    python benchmarks/bench_pipeline.py [--hidden 256 --layers 8 --seq 512 --micro-batch 4
        --microbatches 8] [--quick] --out benchmarks/results/pipeline.json

One Llama-shaped decoder (ms-models, untied head) at a size where compute, not dispatch,
dominates, trained for a few steps by four runtimes on the same 2 gloo ranks x 1 thread (rank r
pinned to CPU r unless ``--no-pin``), steps alternated so that all see the same machine:

* ms-pipeline 1F1B and ZBV, stages compiled with ``mindspore.jit`` on the models' explicit passes
  (F keeps what B needs, B never re-runs the forward, W is the kept pairs' GEMMs, BW both), and
  "zbv+fused": ZBV with each B that its own W directly follows run as one BW
  (``ms_pipeline.fuse_adjacent_backward``; the W's filling the cool-down stay apart);
* PyTorch's ``Schedule1F1B`` and ``ScheduleZBVZeroBubble`` on the same model in torch (eager, its
  own dI/dW split), same ranks, threads and cut.

Reported per variant: the median step (slowest rank), and for ms-pipeline the run's own trace
(bubble, mean F/B/W per stage), the simulator's makespan under those costs and its error, the
step's peak RSS above its start (the kernel's high-water mark) and in all, next to the
simulator's peak of held values; then rows for
p = 4 and 8 simulated from the measured per-layer costs (each stage keeping the measured stage's
layers). The JSON's ``summary`` holds ``zbv_over_1f1b``, ``torch_zbv_over_1f1b`` and
``simulator_error``.
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
from _pipeline_probes import PeakRSS, held_units, ping_pong
from _pipeline_report import draw_runs, printable, schedule_of, simulated_rows

from ms_layout.comm.netns import rate_for

RANKS = 2
MS = ("1f1b", "zbv", "zbv+fused", "zbv+auto", "zbv+1b1f")
SHAPED = ("1f1b", "zbv", "zbv+1b1f")  # the variants run again over the shaped link
TORCH = ("torch 1f1b", "torch zbv")


def _config(args):
    import ms_models

    return ms_models.tiny_config(
        "llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or int(2.6875 * args.hidden),
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=max(256, args.seq),
        tie_word_embeddings=False,
    )


def layer_counts(layers: int, stages: int) -> list[int]:
    """Decoder layers per stage, as even as they go (the first stages take the remainder)."""
    if layers < stages:
        raise SystemExit(f"--layers {layers} is fewer than the {stages} stages of ZBV on {RANKS} ranks")
    return [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]


def block_counts(layers: int, stages: int) -> list[int]:
    """Blocks per stage: the embedding joins stage 0, the head the last stage."""
    counts = layer_counts(layers, stages)
    counts[0] += 1
    counts[-1] += 1
    return counts


def _rank(group, args, variants=MS, with_torch=True):
    import _torch_pipeline_peer as peer
    import mindspore as ms
    import torch

    import ms_models
    import ms_pipeline as mp
    from ms_pipeline.runtime import setup_cpu

    setup_cpu(1)
    torch.set_num_threads(1)
    config = _config(args)
    shape = _shape(args)
    latency = ping_pong(group, shape)
    model = ms_models.from_config(config, seed=0)
    blocks = ms_models.pipeline_blocks(model)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, args.vocab, (args.microbatches, args.micro_batch, args.seq + 1)).astype(np.int32)
    inputs, labels = [ms.Tensor(x[:, :-1]) for x in ids], [ms.Tensor(x[:, 1:]) for x in ids]
    runtimes, held, compile_s = {}, {}, {}
    for name in variants:
        schedule = schedule_of(name, RANKS, args.microbatches)
        placement = mp.LayerPlacement.from_counts(block_counts(args.layers, schedule.num_stages))
        staged = mp.runtime.split_blocks(blocks, placement)
        mine = {s: staged[s] for s in schedule.stages_of(group.rank)}
        runtimes[name] = mp.runtime.PipelineRuntime(schedule, mine, group, activation_shape=shape, jit=True)
        start = time.perf_counter()
        runtimes[name].step(inputs, labels)  # warm-up: compiles F, B, W / BW of each stage
        compile_s[name] = time.perf_counter() - start
        if name.endswith("+auto"):  # time split and fused backwards, keep the fusions that pay
            start = time.perf_counter()
            runtimes[name].tune_backward(inputs, labels, comm=latency)
            compile_s[name + " tune"] = time.perf_counter() - start
        held[name] = held_units(runtimes[name], shape, args.vocab)
    t_ids = torch.from_numpy(ids[:, :, :-1].reshape(-1, args.seq).astype(np.int64))
    t_labels = torch.from_numpy(ids[:, :, 1:].reshape(-1, args.seq).astype(np.int64))
    torch_runs = {}
    for name in TORCH if with_torch else ():
        kind = name.split()[1]
        counts = layer_counts(args.layers, RANKS * (2 if kind == "zbv" else 1))
        last_rank = RANKS - 1 if kind == "1f1b" else 0
        schedule, modules = peer.build(kind, config, group.rank, RANKS, args.microbatches, counts)
        torch_runs[name] = (schedule, modules, last_rank)
        start = time.perf_counter()
        peer.step(schedule, modules, group.rank, last_rank, t_ids, t_labels)  # warm-up
        compile_s[name] = time.perf_counter() - start
    names = (*variants, *(TORCH if with_torch else ()))
    out = {name: {"times": [], "events": [], "rss": [], "rss_total": []} for name in names}
    rss = PeakRSS()
    for _ in range(args.steps):
        for name in names:  # alternated: every variant sees the same machine
            group.barrier()
            with rss:
                start = time.perf_counter()
                if name in runtimes:
                    runtimes[name].zero_grads()
                    result = runtimes[name].step(inputs, labels)
                    out[name]["events"].append(result.events)
                else:
                    peer.step(*torch_runs[name][:2], group.rank, torch_runs[name][2], t_ids, t_labels)
                out[name]["times"].append(time.perf_counter() - start)
            out[name]["rss"].append(rss.peak - rss.start)
            out[name]["rss_total"].append(rss.peak)
    for name in out:
        out[name].update(latency=latency, held=held.get(name), compile_s=compile_s[name])
        if name in runtimes:
            out[name].update(schedule=runtimes[name].schedule.to_dict(), tune_s=compile_s.get(name + " tune"))
    return out


def _stage_costs(schedule, events, fallback=None):
    """Mean F, B, W and BW per stage over the measured steps: {"f", "b", "w", "bw"} lists. The mean,
    not the median: a makespan adds durations, slow tail included (with medians the prediction of
    ZBV's 48 actions a rank fell 4-5 % short of the step). A stage that ran no separate B (or W)
    takes it from ``fallback`` (the unfused run's costs)."""
    from ms_pipeline import Kind, mean_durations

    mean = mean_durations([e for step_events in events for e in step_events])
    stages = range(schedule.num_stages)
    out = {"f": [mean[(s, Kind.F)] for s in stages]}
    for key, kind in (("b", Kind.B), ("w", Kind.W), ("bw", Kind.BW)):
        values = [mean.get((s, kind)) for s in stages]
        if any(v is None for v in values) and fallback is not None and fallback.get(key) is not None:
            values = [fallback[key][s] if v is None else v for s, v in zip(stages, values)]
        out[key] = values if all(v is not None for v in values) else None
    return out


def _held(per_rank, num_stages):
    """(bytes after F, bytes after B) of each stage, from the ranks that hold them."""
    merged = {}
    for r in per_rank:
        merged.update({int(s): v for s, v in r["held"].items()})
    return [merged[s] for s in range(num_stages)]


def _ms_row(name, args, per_rank, fallback=None):
    import ms_pipeline as mp

    schedule = mp.Schedule.from_dict(per_rank[0]["schedule"])  # "+auto": as the runtime tuned it
    common = _measured(name, args, per_rank)
    steps = len(common["step_times_s"])
    events = [[e for r in per_rank for e in r["events"][i] if e.action.is_compute] for i in range(steps)]
    measured = [mp.Bubbles.of(ev, RANKS) for ev in events]
    c = _stage_costs(schedule, events, fallback)
    if c["b"] is None:  # 1F1B: every backward is a BW
        f, b, w, bw = c["f"], c["bw"], [0.0] * schedule.num_stages, None
    else:
        f, b, w, bw = c["f"], c["b"], c["w"], c["bw"]
    held = _held(per_rank, schedule.num_stages)
    mem_f = [h[0] / 2**20 for h in held]
    mem_b = [(h[1] - h[0]) / 2**20 for h in held]
    mem_w = [-h[1] / 2**20 for h in held]
    costs = mp.CostModel(f=f, b=b, w=w, bw=bw, comm=per_rank[0]["latency"], mem_f=mem_f, mem_b=mem_b, mem_w=mem_w)
    predicted = mp.simulate(mp.split_pairs(schedule), costs)  # a 1B1F pair runs as its halves
    step = common["step_s"]
    row = {
        **common,
        "predicted_s": predicted.makespan,
        "simulator_error": abs(predicted.makespan - step) / step,
        "trace_makespan_s": statistics.median(x.makespan for x in measured),
        "measured_bubble": statistics.median(x.bubble_rate for x in measured),
        # every step's trace obeys the schedule it ran (order, no overlap, dependencies)
        "trace_problems": sum(len(mp.check_trace(mp.split_pairs(schedule), ev)) for ev in events),
        "predicted_bubble": predicted.bubble_rate,
        "f_ms": 1e3 * statistics.fmean(f),
        "b_ms": 1e3 * statistics.fmean(b),
        "w_ms": 1e3 * statistics.fmean(w),
        "bw_ms": 1e3 * statistics.fmean(bw) if bw else None,
        "comm_ms": 1e3 * per_rank[0]["latency"],
        "predicted_held_mb": max(predicted.peak_activation),
        "compile_s": max(r["compile_s"] for r in per_rank),
    }
    if per_rank[0]["tune_s"] is not None:
        row["tune_s"] = max(r["tune_s"] for r in per_rank)
        row["split_w"] = sum(a.kind is mp.Kind.W for actions in schedule.actions for a in actions)
    return row, c


def _measured(name, args, per_rank) -> dict:
    """What every variant's row holds: its step times (slowest rank per round), their median and
    the peak RSS, above the step's start and in all (the rank's worst median)."""
    steps = len(per_rank[0]["times"])
    step_times = [max(r["times"][i] for r in per_rank) for i in range(steps)]
    return {
        "step_times_s": step_times,
        "schedule": name,
        "ranks": RANKS,
        "microbatches": args.microbatches,
        "step_s": statistics.median(step_times),
        "peak_rss_mb": max(statistics.median(r["rss"]) for r in per_rank) / 2**20,
        "rss_total_mb": max(statistics.median(r["rss_total"]) for r in per_rank) / 2**20,
    }


def _shape(args) -> tuple[int, int, int]:
    """The activation crossing between stages (and its gradient)."""
    return (args.micro_batch, args.seq, args.hidden)


def _rows(args, results, variants, torch_variants):
    """The table rows of one run (ms-pipeline variants, then torch's), with the ratios to 1F1B
    and to the peer; and the measured per-stage costs of each ms-pipeline variant."""
    rows, costs = [], {}
    for name in variants:
        row, costs[name] = _ms_row(name, args, [r[name] for r in results], costs.get("zbv"))
        rows.append(row)
    rows += [_measured(name, args, [r[name] for r in results]) for name in torch_variants]
    by = {r["schedule"]: r for r in rows}
    for r in rows:
        base = by["torch 1f1b" if r["schedule"].startswith("torch") else "1f1b"]
        r["/1f1b"] = r["step_s"] / base["step_s"]
        # each timed round runs every variant once, back to back: the ratio within a round cancels
        # the box's drift between rounds (this machine's speed moves by up to 1.4x within minutes)
        paired = [a / b for a, b in zip(r["step_times_s"], base["step_times_s"])]
        r["/1f1b_paired"] = statistics.median(paired)
        r["/1f1b_paired_range"] = [min(paired), max(paired)]
        peer = by.get("torch " + r["schedule"].split("+")[0])
        if peer is not None:
            r["torch_step/step"] = peer["step_s"] / r["step_s"]
    return rows, costs


def _pair_summary(by, suffix) -> dict:
    """ZBV with 1B1F pairs over plain ZBV: measured, and as the simulator predicted it."""
    pair, plain = by["zbv+1b1f"], by["zbv"]
    return {
        f"zbv_1b1f_over_plain{suffix}": pair["step_s"] / plain["step_s"],
        f"zbv_1b1f_over_plain_predicted{suffix}": pair["predicted_s"] / plain["predicted_s"],
    }


def _run_shaped(args, rate):
    """The ms-pipeline variants again, each rank in a network namespace on links held to `rate`;
    a string says why that cannot run here (not root, no namespaces)."""
    from ms_layout.comm import run_local
    from ms_layout.comm.netns import ShapedNetwork, available

    ok, why = available()
    if not ok:
        return why
    with ShapedNetwork(RANKS, rate=rate) as net:
        return run_local(
            _rank, RANKS, backend="gloo", args=(args, SHAPED, False), timeout=3000,
            env={"OMP_NUM_THREADS": "1"}, network=net, pin_cpus=args.pin,
        )  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sample (default 512)")
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per microbatch (default 4)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary (default 2048)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    parser.add_argument("--intermediate", type=int, default=0, help="MLP width (default 2.6875 x hidden)")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per variant (default 6, 3 with --quick)")
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--out", default="benchmarks/results/pipeline.json")
    parser.add_argument("--draw", metavar="DIR", help="also write PNG timelines of the fastest measured steps")
    parser.add_argument("--rate", default="auto", help="shaped link rate (tc units: 200mbit), 'auto', or 'none'")
    parser.add_argument("--share", type=float, default=0.4, help="with --rate auto: one transfer / one ZBV stage's F")
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false", help="leave the ranks unpinned (default: rank r on CPU r)"
    )
    args = parser.parse_args(argv)
    if not 0 < args.share < 10:
        parser.error(f"--share must be within (0, 10), got {args.share}")
    args.steps = args.steps or (3 if args.quick else 6)
    for flag in ("hidden", "layers", "seq", "micro_batch", "microbatches", "vocab", "heads", "kv_heads", "steps"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error(f"--hidden {args.hidden}, --heads {args.heads}, --kv-heads {args.kv_heads} do not divide")
    layer_counts(args.layers, 2 * RANKS)
    from ms_layout.comm import run_local

    start = time.perf_counter()
    results = run_local(
        _rank, RANKS, backend="gloo", args=(args,), timeout=3000, env={"OMP_NUM_THREADS": "1"}, pin_cpus=args.pin
    )
    print(f"ran in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    rows, costs = _rows(args, results, MS, TORCH)
    by = {r["schedule"]: r for r in rows}
    simulated = simulated_rows(args, costs)
    shaped_rows, shaped = [], {"rate": None}
    if args.rate != "none":
        rate = args.rate
        if rate == "auto":  # one activation crosses the link in `share` of a ZBV stage's forward
            rate = rate_for(int(np.prod(_shape(args))) * 4, args.share * statistics.fmean(costs["zbv"]["f"]))
        shaped = {"rate": rate, "share_asked": args.share if args.rate == "auto" else None}
        got = _run_shaped(args, rate)
        if isinstance(got, str):
            print(f"shaped-link run skipped: {got}", file=sys.stderr)
            shaped["skipped"] = got
        else:
            shaped_rows, _ = _rows(args, got, SHAPED, ())
            shaped["comm_ms"] = shaped_rows[0]["comm_ms"]
            shaped["comm_share"] = shaped["comm_ms"] / by["zbv"]["f_ms"]
            if args.draw:
                draw_runs(args.draw, got, args, SHAPED, RANKS, suffix="-shaped")
    if args.draw:
        draw_runs(args.draw, results, args, MS, RANKS)
    model = {k: getattr(args, k) for k in ("hidden", "layers", "seq", "micro_batch", "microbatches", "vocab", "heads")}
    title = (
        f"ZeroBubbleV vs 1F1B, {RANKS} CPU ranks x 1 thread, Llama d={args.hidden} x {args.layers} layers, "
        f"seq {args.seq}, micro-batch {args.micro_batch}, m={args.microbatches}: ms-pipeline (jit) beside PyTorch"
    )
    print_table([printable(r) for r in rows], title)
    print_table([{k: f"{v:.4g}" if isinstance(v, float) else v for k, v in r.items()} for r in simulated], "simulated")
    if shaped_rows:
        where = f"the same over a shaped link ({shaped['rate']} per direction, network namespaces)"
        print_table([printable(r) for r in shaped_rows], where)
    machine = machine_info("mindspore", "torch", ranks=RANKS, threads_per_rank=1, model=model, pinned=args.pin)
    summary = {
        "zbv_over_1f1b": by["zbv"]["step_s"] / by["1f1b"]["step_s"],
        "zbv_fused_over_1f1b": by["zbv+fused"]["step_s"] / by["1f1b"]["step_s"],
        "zbv_auto_over_1f1b": by["zbv+auto"]["step_s"] / by["1f1b"]["step_s"],
        "zbv_auto_over_1f1b_paired": by["zbv+auto"]["/1f1b_paired"],
        "torch_zbv_over_1f1b": by["torch zbv"]["step_s"] / by["torch 1f1b"]["step_s"],
        "zbv_over_1f1b_paired": by["zbv"]["/1f1b_paired"],
        "torch_zbv_over_1f1b_paired": by["torch zbv"]["/1f1b_paired"],
        "simulator_error": max(r["simulator_error"] for r in rows if "simulator_error" in r),
        "ms_zbv_over_torch_zbv_step": by["zbv"]["step_s"] / by["torch zbv"]["step_s"],
        "trace_problems": sum(r.get("trace_problems", 0) for r in rows + shaped_rows),
        **_pair_summary(by, ""),
        "load_avg_1m": machine["load_avg_1m"],
        "pinned": args.pin,
    }
    if shaped_rows:
        sby = {r["schedule"]: r for r in shaped_rows}
        summary.update(_pair_summary(sby, "_shaped"))
        summary["zbv_over_1f1b_shaped"] = sby["zbv"]["step_s"] / sby["1f1b"]["step_s"]
        summary["simulator_error_shaped"] = max(r["simulator_error"] for r in shaped_rows)
        summary["comm_share_shaped"] = shaped["comm_share"]
    report = {
        "benchmark": "pipeline",
        "title": title,
        "summary": summary,
        "machine": machine,
        "rows": rows,
        "simulated_rows": simulated,
        "shaped": shaped,
        "shaped_rows": shaped_rows,
    }
    print(json.dumps(summary, indent=2))
    write_result(Path(args.out), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
