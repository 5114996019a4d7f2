"""ms-rlhf: packing efficiency, GRPO step time packed vs padded, rollout makespan of uniform
sampling vs a contiguous split, and weight-sync time with ms-reshard vs gather-everything.

    python benchmarks/bench_rlhf.py [--quick] [--out benchmarks/results/rlhf.json]

Length distributions are synthetic and say so: RL response lengths are long-tailed with a spike
at the length limit (responses cut at max tokens); we draw log-normal lengths and clip them at
the limit. "reasoning" is median 1500 / cap 8192 tokens (math-reasoning RL scale), "chat" median
300 / cap 2048, "uniform" is U(1, cap). The CPU timing sections scale the same shape down
(median 40 / cap 224) so a tiny MindSpore model can run them on two cores.

Every figure is measured side by side in one run; ratios are ours / baseline (or baseline / ours
for speed-ups, named so). Timings on a shared 2-core machine are noisy: each timed item is the
minimum over repeats, taken in rotation so load hits every column alike.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import numpy as np
from _common import machine_info, write_result
from _rlhf_packing import bench_packing


# ------------------------------------------------------------------------------------ B. step time
def bench_step(quick):
    import ms_models
    from ms_rlhf import build_row, plan_packs, sample_weights
    from ms_rlhf.loss import per_token
    from ms_rlhf.runtime.policy import PolicyFunctions

    cfg = ms_models.tiny_config(
        "llama",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    model = ms_models.from_config(cfg, seed=0)
    fns = PolicyFunctions(model, 0.2, 0.01, jit=True)
    rng = np.random.default_rng(1)
    n, width, rows_per_mb = (32 if quick else 64), 256, 4
    resp = np.clip(rng.lognormal(np.log(40), 0.9, n).astype(int), 1, 224)
    prompts = rng.integers(8, 33, n)
    seqs = [rng.integers(3, 64, p + r) for p, r in zip(prompts, resp)]
    w = sample_weights(resp)
    adv = rng.normal(size=n)
    plan = plan_packs([len(s) for s in seqs], width)
    layouts = {
        "packed": [[list(p) for p in plan.packs[i : i + rows_per_mb]] for i in range(0, plan.num_packs, rows_per_mb)],
        "padded": [[[s] for s in range(i, min(i + rows_per_mb, n))] for i in range(0, n, rows_per_mb)],
    }

    layouts["bucketed"] = layouts["padded"]

    def bucket(mb):  # the next power of two >= the longest sample: a few compiled shapes, less padding
        return max(32, 1 << int(np.ceil(np.log2(max(len(seqs[s]) for row in mb for s in row)))))

    def run(kind):
        loss = 0.0
        for mb in layouts[kind]:
            wide = bucket(mb) if kind == "bucketed" else width
            rows = [build_row(r, seqs, prompts, wide) for r in mb + [[]] * (rows_per_mb - len(mb))]
            zeros = [np.zeros(wide, np.float32)] * len(rows)
            stats, _ = fns.loss_and_grads(rows, [per_token(r, w) for r in rows], adv, zeros, zeros)
            loss += stats.loss
        return loss

    losses = {k: run(k) for k in layouts}  # compiles once (one shape) and checks the two agree
    best = {k: np.inf for k in layouts}
    for _ in range(2 if quick else 3):
        for k in layouts:
            start = time.perf_counter()
            run(k)
            best[k] = min(best[k], time.perf_counter() - start)
    tokens = int(sum(len(s) for s in seqs))
    case = f"{n} samples (median resp 40, cap 224), 4 rows per micro-batch, mindspore.jit"
    return [
        {
            "section": "step time",
            "case": case,
            "metric": "fwd+bwd s",
            "ours": best["packed"],
            "baseline": best[k],
            "vs": vs,
            "ratio": best["packed"] / best[k],
            "note": f"{plan.num_packs} packs of 256 vs {n} rows; {tokens} tokens; |loss diff| "
            f"{abs(losses['packed'] - losses[k]):.1e}",
        }
        for k, vs in (("padded", "padded to 256 (one shape)"), ("bucketed", "padded to 2^k >= longest"))
    ]


# ------------------------------------------------------------------------------------ C. makespan
def bench_makespan(quick):
    import ms_models
    from ms_rlhf import balanced_split, contiguous_split, uniform_split
    from ms_rlhf.runtime.rollout import EmbeddedEngine, Request

    cfg = ms_models.tiny_config(
        "llama",
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    engine = EmbeddedEngine(ms_models.from_config(cfg, seed=0), eos_id=2, mode="jit")
    rng = np.random.default_rng(2)
    prompts, n, dp, cap = (8, 8, 4, 4) if quick else (16, 8, 4, 8)
    per_prompt = np.clip(rng.lognormal(np.log(10), 0.8, prompts), 2, 40)  # a prompt's answers share a length scale
    stop = [int(np.clip(per_prompt[r // n] * rng.uniform(0.75, 1.25), 1, 48)) for r in range(prompts * n)]
    reqs = [Request(r, tuple(rng.integers(3, 32, 6)), (0, 0, r), 48, stop_after=stop[r]) for r in range(prompts * n)]
    strategies = {
        "contiguous": contiguous_split(prompts, n, dp),
        "uniform": uniform_split(prompts, n, dp),
        "balanced": balanced_split(np.repeat(per_prompt, n), dp),  # predicted = the prompt's length scale
    }
    engine.generate(reqs[:cap], batch=cap)  # compile
    rows = []
    for label, slots in ((f"continuous batching, {cap} seqs per instance", cap), ("all requests at once", None)):
        best = {k: np.full(dp, np.inf) for k in strategies}
        calls = {k: np.zeros(dp, int) for k in strategies}
        names = list(strategies)
        for rep in range(2 if quick else 5):
            for k in names[rep % 3 :] + names[: rep % 3]:  # rotate the order: load hits each alike
                a = strategies[k]
                for i, inst in enumerate(a.instances):
                    batch = slots or max(len(x) for x in a.instances)
                    engine.calls, start = 0, time.perf_counter()
                    engine.generate([reqs[r] for r in inst], batch=batch)
                    best[k][i] = min(best[k][i], time.perf_counter() - start)
                    calls[k][i] = engine.calls
        case = f"{prompts}x{n} requests on {dp} instances, {label}"
        tokens = {k: [int(sum(stop[r] for r in i)) for i in a.instances] for k, a in strategies.items()}
        for k in ("uniform", "balanced"):
            rows.append(
                {
                    "section": "rollout makespan",
                    "case": case,
                    "metric": f"{k}: engine steps",
                    "ours": int(calls[k].max()),
                    "baseline": int(calls["contiguous"].max()),
                    "vs": "contiguous split",
                    "ratio": calls[k].max() / calls["contiguous"].max(),
                    "note": f"steps per instance {calls[k].tolist()} vs {calls['contiguous'].tolist()}; "
                    f"tokens {tokens[k]} vs {tokens['contiguous']}",
                }
            )
            rows.append(
                {
                    "section": "rollout makespan",
                    "case": case,
                    "metric": f"{k}: seconds",
                    "ours": float(best[k].max()),
                    "baseline": float(best["contiguous"].max()),
                    "vs": "contiguous split",
                    "ratio": float(best[k].max() / best["contiguous"].max()),
                    "note": "slowest instance, wall clock (instances timed one after another)",
                }
            )
    return rows


# ------------------------------------------------------------------------------------ D. weight sync
def _sync_rank(group, layers, hidden, vocab, cases, reps):
    import mindspore as ms

    import ms_models
    from ms_layout import ParallelConfig, unshard
    from ms_reshard import ParamSpec, model_plan, reshard_parameters, stored_layout

    ms.set_device("CPU")
    me = group.rank
    cfg = ms_models.tiny_config(
        "llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
    )
    shapes = {k: tuple(v) for k, v in ms_models.param_shapes(cfg).items()}
    rng = np.random.default_rng(0)
    full = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}

    def specs(parallel, sharded):
        out = {}
        for name, placement in ms_models.model_layouts(cfg, parallel).items():
            layout = stored_layout(placement.layout, shapes[name]) if sharded else placement.layout
            out[name] = ParamSpec(layout, shapes[name], "float32")
        return out

    out = []
    for label, train, infer in cases:
        src, dst = specs(ParallelConfig(**train), True), specs(ParallelConfig(**infer), False)
        shards = {n: ms.Tensor(full[n][s.layout.global_slice(s.shape, me)].copy()) for n, s in src.items()}
        targets = {
            n: ms.Parameter(ms.Tensor(np.zeros(s.layout.shard_shape(s.shape), np.float32)), name=n)
            for n, s in dst.items()
        }
        plan = model_plan(src, dst)

        def via_reshard(plan=plan, shards=shards, targets=targets):
            reshard_parameters(plan, group, shards, targets)

        def gather_everything(src=src, dst=dst, shards=shards, targets=targets):
            # every rank all-gathers every full parameter, then keeps its target slice
            for n, s in src.items():
                stacked = group.all_gather(shards[n].asnumpy()[None], axis=0)
                whole = unshard({r: stacked[i] for i, r in enumerate(group.ranks)}, s.layout)
                d = dst[n]
                targets[n].copy_(ms.Tensor(np.ascontiguousarray(whole[d.layout.global_slice(d.shape, me)])))

        times = {"reshard": [], "gather": []}
        for _ in range(reps):
            for k, fn in (("reshard", via_reshard), ("gather", gather_everything)):
                group.barrier()
                start = time.perf_counter()
                fn()
                group.barrier()
                times[k].append(time.perf_counter() - start)
        ok = all(
            np.array_equal(targets[n].asnumpy(), full[n][d.layout.global_slice(d.shape, me)]) for n, d in dst.items()
        )
        gathered = sum(int(np.prod(s)) * 4 * (group.size - 1) // group.size for s in shapes.values())
        recv = plan.per_rank().get(me, {}).get("received", 0)
        # transient buffer per parameter: gather-everything rebuilds the full tensor on every rank,
        # the reshard executor only the target shard it writes
        gather_peak = max(int(np.prod(s)) * 4 for s in shapes.values())
        reshard_peak = max(int(np.prod(d.layout.shard_shape(d.shape))) * 4 for d in dst.values())
        out.append(
            {
                "case": label,
                "reshard_s": min(times["reshard"]),
                "gather_s": min(times["gather"]),
                "ok": ok,
                "recv_bytes": recv,
                "gather_recv_bytes": gathered,
                "gather_peak": gather_peak,
                "reshard_peak": reshard_peak,
            }
        )
    return out


def bench_sync(quick):
    from ms_layout.comm import run_local

    layers, hidden, vocab = (2, 128, 2048) if quick else (4, 256, 8192)
    cases = [
        ("ZeRO dp4 -> replicated dp4 (the trainer's sync)", {"dp": 4, "optimizer_shard": True}, {"dp": 4}),
        ("dp2 tp2 ZeRO -> tp4 inference", {"dp": 2, "tp": 2, "optimizer_shard": True}, {"tp": 4}),
        ("dp2 tp2 ZeRO -> dp2 tp2 inference", {"dp": 2, "tp": 2, "optimizer_shard": True}, {"dp": 2, "tp": 2}),
    ]
    reps = 2 if quick else 3
    results = run_local(_sync_rank, 4, backend="gloo", timeout=900, args=(layers, hidden, vocab, cases, reps))
    rows = []
    for i, (label, _, _) in enumerate(cases):
        per = [r[i] for r in results]
        reshard_s, gather_s = max(p["reshard_s"] for p in per), max(p["gather_s"] for p in per)
        rows.append(
            {
                "section": "weight sync",
                "case": f"{label}; {layers} layers, hidden {hidden}, vocab {vocab}",
                "metric": "seconds (4 gloo ranks)",
                "ours": reshard_s,
                "baseline": gather_s,
                "vs": "all-gather every full tensor",
                "ratio": reshard_s / gather_s,
                "note": f"received/rank {max(p['recv_bytes'] for p in per) / 2**20:.1f} MiB vs "
                f"{per[0]['gather_recv_bytes'] / 2**20:.1f} MiB; largest transient buffer "
                f"{per[0]['reshard_peak'] / 2**20:.1f} vs {per[0]['gather_peak'] / 2**20:.1f} MiB; "
                f"targets correct={all(p['ok'] for p in per)}",
            }
        )
    return rows


def summary(rows) -> dict:
    """Headline ratios (ours / baseline) by section: the first row of each (section, vs) pair."""
    out: dict = {}
    for row in rows:
        case = row["case"].split(":")[0].split(" ")[0] if row["section"] == "packing" else row["section"]
        key = re.sub(r"[^A-Za-z0-9]+", "_", f"{row['section']} {case} {row['metric']} vs {row['vs']}").strip("_")
        out.setdefault(key, row["ratio"])
        if "max_over_bound" in row:
            out.setdefault("packing_count_cap_max_over_bound", row["max_over_bound"])
            out[re.sub(r"[^A-Za-z0-9]+", "_", f"packing count cap max over bound {row['vs']}")] = row[
                "baseline_max_over_bound"
            ]
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument("--only", default=None, help="comma-separated sections: packing,step,makespan,sync")
    args = parser.parse_args(argv)
    import mindspore as ms

    ms.set_device("CPU")
    start = time.perf_counter()
    sections = {"packing": bench_packing, "step": bench_step, "makespan": bench_makespan, "sync": bench_sync}
    chosen = args.only.split(",") if args.only else list(sections)
    rows = []
    for name in chosen:
        t0 = time.perf_counter()
        rows += sections[name](args.quick)
        print(f"[{name}] {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    for row in rows:
        for k, v in row.items():
            if isinstance(v, (float, np.floating)):
                row[k] = round(float(v), 4)
            elif isinstance(v, np.integer):
                row[k] = int(v)
    result = {
        "benchmark": "rlhf",
        "summary": summary(rows),
        "title": "ms-rlhf: packing vs next-fit and padding, packed vs padded GRPO step, uniform vs contiguous "
        "rollout makespan, ms-reshard vs gather-everything weight sync (ratio = ours / baseline)",
        "machine": machine_info("mindspore", "torch"),
        "quick": args.quick,
        "wall_s": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=result["title"])
        for col in ("section", "case", "metric", "ours", "baseline", "vs", "ratio", "note"):
            table.add_column(col)
        for row in rows:
            table.add_row(
                *(str(row.get(c, "")) for c in ("section", "case", "metric", "ours", "baseline", "vs", "ratio", "note"))
            )
        Console(width=max(Console().width, 200)).print(table)
    except ImportError:
        for row in rows:
            print(row)
    if args.out:
        write_result(Path(args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
