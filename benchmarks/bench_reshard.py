"""bench_reshard: planning time at DeepSeek-V3 scale, bytes moved against baselines, online throughput.

    python benchmarks/bench_reshard.py [--quick] --out benchmarks/results/reshard.json
    python benchmarks/bench_reshard.py --planning-only [--ranks 4096]   # section 1 only

1. Planning: the whole DeepSeek-V3 parameter list (61 layers, 256 routed experts, MLA, hidden 7168;
   45k names synthesized with HF names and shapes) from a training config (tp=8, pp=16, ep=32 with
   optimizer sharding; and the earlier pp=16, ep=64 without tp) to a serving config (tp=8,
   ep=128/256), on 1024 and 4096 ranks: seconds to derive the layouts (ms_layout.param_placement)
   and to plan, peak RSS of the planning process (each row runs in its own process), distinct plans,
   bytes moved against the lower bound and against gathering everything then slicing.
2. Bytes: single tensors between layout pairs: ours, the lower bound, the naive plan, and MindSpore's
   own redistribution (mindspore.parallel._tensor._transform_tensor_by_layout, the offline helper
   its checkpoint transform uses), for the pairs it can plan; the others say why not.
3. Online: a Llama-like model (hidden 512, 4 layers) resharded from dp=2,tp=2 with optimizer
   sharding to tp=4 with fused qkv/gate_up on 4 CPU ranks over gloo, against a plain memcpy of the
   same bytes in one process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

import numpy as np
from _common import machine_info

from ms_layout import Layout, ParallelConfig
from ms_reshard import DEFAULT_FUSIONS, PlanCache, model_plan, param_specs, plan
from ms_reshard.plan import naive_gather_bytes

GB, MB = 1e9, 1e6


# ---------------------------------------------------------------- 1. planning at scale
def deepseek_v3_shapes(layers: int = 61, dense: int = 3, experts: int = 256) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3), MTP omitted."""
    hidden, vocab, inter, moe_inter = 7168, 129280, 18432, 2048
    heads, q_rank, kv_rank, nope, rope, v_dim = 128, 1536, 512, 128, 64, 128
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        s |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_a_proj.weight": (q_rank, hidden),
            p + "self_attn.q_a_layernorm.weight": (q_rank,),
            p + "self_attn.q_b_proj.weight": (heads * (nope + rope), q_rank),
            p + "self_attn.kv_a_proj_with_mqa.weight": (kv_rank + rope, hidden),
            p + "self_attn.kv_a_layernorm.weight": (kv_rank,),
            p + "self_attn.kv_b_proj.weight": (heads * (nope + v_dim), kv_rank),
            p + "self_attn.o_proj.weight": (hidden, heads * v_dim),
        }
        if i < dense:
            s |= {p + f"mlp.{n}_proj.weight": (inter, hidden) for n in ("gate", "up")}
            s[p + "mlp.down_proj.weight"] = (hidden, inter)
            continue
        s |= {p + "mlp.gate.weight": (experts, hidden), p + "mlp.gate.e_score_correction_bias": (experts,)}
        for q in [p + "mlp.shared_experts."] + [f"{p}mlp.experts.{e}." for e in range(experts)]:
            s |= {q + "gate_proj.weight": (moe_inter, hidden), q + "up_proj.weight": (moe_inter, hidden)}
            s[q + "down_proj.weight"] = (hidden, moe_inter)
    s["model.norm.weight"] = (hidden,)
    s["lm_head.weight"] = (vocab, hidden)
    return s


SCALES = {  # the issue-23 target: train tp8 pp16 ep32 + ZeRO -> serve tp8 ep
    1024: (ParallelConfig(tp=8, pp=16, dp=8, ep=8, optimizer_shard=True), ParallelConfig(dp=128, tp=8, ep=128)),
    4096: (ParallelConfig(tp=8, pp=16, dp=32, ep=32, optimizer_shard=True), ParallelConfig(dp=512, tp=8, ep=256)),
}
SCALES_NO_TP = {  # what the benchmark planned before (kept for comparison: a ZeRO shard per dp rank)
    1024: (ParallelConfig(pp=16, dp=64, ep=64, optimizer_shard=True), ParallelConfig(dp=128, tp=8, ep=128)),
    4096: (ParallelConfig(pp=16, dp=256, ep=64, optimizer_shard=True), ParallelConfig(dp=512, tp=8, ep=256)),
}
CONFIGS = {"tp8": SCALES, "no-tp": SCALES_NO_TP}


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB


def _short(c: ParallelConfig) -> str:
    sizes = " ".join(f"{k}{getattr(c, k)}" for k in ("tp", "pp", "dp", "ep") if getattr(c, k) > 1)
    return sizes + (" +ZeRO" if c.optimizer_shard else "")


def bench_planning(world: int, layers: int, config: str = "tp8", repeats: int = 3) -> dict:
    """Layouts and plan of the whole model, each from scratch `repeats` times (the best time is
    reported: the benchmark machine is shared)."""
    train, infer = CONFIGS[config][world]
    shapes = deepseek_v3_shapes(layers)
    # 61 layers on 16 stages: three stages of 3 layers, thirteen of 4 (fewer where embed/head sit)
    per_chunk = [3, 3, 3] + [4] * 13 if layers == 61 else None
    layouts_s = plan_s = math.inf
    for _ in range(repeats):
        src = dst = mp = cache = None  # the previous repeat's plans are garbage before this one's peak
        t0 = time.perf_counter()
        src = param_specs(shapes, train, layers, 256, dtype="bfloat16", layers_per_chunk=per_chunk)
        dst = param_specs(shapes, infer, layers, 256, dtype="bfloat16")
        t1 = time.perf_counter()
        cache = PlanCache()
        mp = model_plan(src, dst, cache=cache)
        t2 = time.perf_counter()
        layouts_s, plan_s = min(layouts_s, t1 - t0), min(plan_s, t2 - t1)
    moved, lower = mp.bytes_moved(), mp.lower_bound_total()
    naive = sum(naive_gather_bytes(m.plan) for m in mp.moves)
    multicasts = sum(len(p.multicast) for p in cache.canonical.values() if p.multicast is not None)
    return {
        "section": "planning",
        "case": f"DeepSeek-V3 {layers} layers, {world} ranks, {config}",
        "train": _short(train),
        "serve": _short(infer),
        "params": len(shapes),
        "layouts_s": round(layouts_s, 2),
        "plan_s": round(plan_s, 2),
        "peak_rss_GB": round(peak_rss_gb(), 2),
        "plans_computed": cache.computed,
        "multicast_rows": multicasts,
        "plans_reused": len(mp.moves) - cache.computed,
        "moved_GB": round(moved / GB, 1),
        "lower_bound_GB": round(lower / GB, 1),
        "naive_GB": round(naive / GB, 1),
        "moved/lower_bound": round(moved / lower, 4),
        "naive/moved": round(naive / moved, 2),
    }


# ---------------------------------------------------------------- 2. bytes against MindSpore
def _pairs() -> list[tuple[str, Layout, Layout, tuple[int, ...]]]:
    t8, t4 = Layout((8,), ("tp",)), Layout((4,), ("tp",))
    d2t4, d4t2 = Layout((2, 4), ("dp", "tp")), Layout((4, 2), ("dp", "tp"))
    big = (8192, 8192)
    return [
        ("tp8 column -> dp2 x tp4 column", t8("tp", "None"), d2t4("tp", "None"), big),
        ("dp2 x tp4 column -> tp8 column", d2t4("tp", "None"), t8("tp", "None"), big),
        ("tp8 row -> tp8 column (transpose split)", t8("None", "tp"), t8("tp", "None"), big),
        ("dp2 x tp4 column -> replicated on 8", d2t4("tp", "None"), t8("None", "None"), big),
        ("dp4 x tp2 optimizer-sharded -> tp8", d4t2(("tp", "dp"), "None"), t8("tp", "None"), big),
        ("2x3 mesh -> 3x2 mesh", Layout((2, 3), ("a", "b"))("a", "b"), Layout((3, 2), ("a", "b"))("a", "b"),
         (6144, 6144)),
        ("tp8 on 8 ranks -> tp4 on ranks 0-3", t8("tp", "None"), t4("tp", "None"), big),
        ("pp stage move: tp4 ranks 4-7 -> tp4 ranks 0-3",
         Layout((4,), ("tp",), rank_list=(4, 5, 6, 7))("tp", "None"), t4("tp", "None"), big),
    ]  # fmt: skip


def mindspore_bytes(src: Layout, dst: Layout, shape) -> tuple[int | None, int | None, str]:
    """Bytes MindSpore's offline redistribution receives (total, max rank), or why it cannot plan."""
    if src.ranks != dst.ranks:
        return None, None, "cannot: rank sets differ (its repeat axis replicates the target over all ranks)"
    if any(isinstance(t, tuple) for t in (*src.tensor_map, *dst.tensor_map)):
        return None, None, "cannot: multi-axis tensor map (needs its opt-shard/expand rewrite first)"
    try:
        from mindspore.parallel._tensor import _transform_tensor_by_layout
    except ImportError:
        return None, None, "mindspore not installed"
    from_layout = (list(src.device_matrix), list(src.tensor_map), list(shape))
    to_layout = (list(dst.device_matrix), list(dst.tensor_map), list(shape))
    total, worst = 0, 0
    for rank in src.ranks:
        ops = _transform_tensor_by_layout(from_layout, to_layout, list(src.ranks), rank)
        cur, got = list(src.shard_shape(shape)), 0
        for name, args in ops:
            if name == "StridedSlice":
                k = len(args) // 3
                cur = [args[k + i] - args[i] for i in range(k)]
            elif name == "AllConcat":  # every member receives the others' current blocks
                group, axis = args[:-1], args[-1]
                got += (len(group) - 1) * math.prod(cur)
                cur[axis] *= len(group)
            elif name == "Reshape":
                cur = list(args)
            else:
                return None, None, f"unknown op {name}"
        if tuple(cur) != dst.shard_shape(shape):
            return None, None, f"its ops end in shape {cur} on rank {rank}"
        total, worst = total + got, max(worst, got)
    return total * 2, worst * 2, "planned"


def bench_bytes() -> list[dict]:
    rows = []
    for name, src, dst, shape in _pairs():
        p = plan(src, dst, shape, itemsize=2)
        ms_total, ms_max, note = mindspore_bytes(src, dst, shape)
        ours = p.bytes_moved()
        rows.append(
            {
                "section": "bytes",
                "case": name,
                "shape": "x".join(map(str, shape)),
                "ours_MB": round(ours / MB, 1),
                "ours_max_rank_MB": round(int(p.received.max()) / MB, 1),
                "lower_bound_MB": round(p.lower_bound_total() / MB, 1),
                "naive_MB": round(naive_gather_bytes(p) / MB, 1),
                "mindspore_MB": None if ms_total is None else round(ms_total / MB, 1),
                "mindspore_max_rank_MB": None if ms_max is None else round(ms_max / MB, 1),
                "mindspore/ours": None if ms_total is None or not ours else round(ms_total / ours, 2),
                "collectives": ",".join(sorted({c.kind.value for c in p.collectives})) or "-",
                "mindspore": note,
            }
        )
    return rows


# ---------------------------------------------------------------- 3. online throughput
def llama_shapes(layers=4, hidden=512, inter=1408, vocab=8192) -> dict[str, tuple[int, ...]]:
    s = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        s |= {p + n: (hidden,) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
        s |= {p + f"self_attn.{n}_proj.weight": (hidden, hidden) for n in "qkvo"}
        s |= {p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden)}
        s[p + "mlp.down_proj.weight"] = (hidden, inter)
    return s


ONLINE = {  # ranks -> (train, serve): both on the same ranks, fused qkv/gate_up when serving
    2: (ParallelConfig(dp=2, optimizer_shard=True), ParallelConfig(tp=2)),
    4: (ParallelConfig(dp=2, tp=2, optimizer_shard=True), ParallelConfig(tp=4)),
}


def online_plan(nprocs: int = 4):
    shapes = llama_shapes()
    train, serve = ONLINE[nprocs]
    src = param_specs(shapes, train, num_layers=4)
    dst = param_specs(shapes, serve, num_layers=4, fusions=DEFAULT_FUSIONS)
    return shapes, src, dst, model_plan(src, dst)


def online_rank(group, repeats: int):
    from ms_reshard.exchange import run_plans

    me, n = group.rank, len(group.ranks)
    shapes, src, dst, mp = online_plan(n)
    rng = np.random.default_rng(0)
    weights = {n: rng.standard_normal(s, dtype=np.float32) for n, s in shapes.items()}
    shards = {n: np.ascontiguousarray(weights[n][s.layout.global_slice(s.shape, me)]) for n, s in src.items()}
    out = {n: np.empty(s.layout.shard_shape(s.shape), np.float32) for n, s in dst.items() if me in s.layout.ranks}
    items = []
    for m in mp.moves:
        p = m.plan
        n_src, n_dst = p.src.shard_shape(p.shape)[m.dim], p.dst.shard_shape(p.shape)[m.dim]
        s_part = shards[m.src_name][m.src_offset : m.src_offset + n_src] if me in p.src.ranks else None
        d_part = out[m.dst_name][m.dst_offset : m.dst_offset + n_dst] if me in p.dst.ranks else None
        items.append((p, s_part, d_part, None))
    times = {"per_tensor": [], "bucketed": []}
    for _ in range(repeats):
        for mode, bucket in (("per_tensor", None), ("bucketed", 64 << 20)):
            group.barrier()
            t0 = time.perf_counter()
            run_plans(items, group, collectives=False, bucket_bytes=bucket)
            group.barrier()
            times[mode].append(time.perf_counter() - t0)
    ok = all(np.array_equal(out[n], _expected(n, s, weights, me)) for n, s in out_specs(dst, me))
    # Transport floors: this rank's share of the reshard's bytes (moved / n) as one message around a
    # ring, and as one all-to-all (equal parts to every other rank, one batch).
    from ms_layout.comm import P2POp

    size = mp.bytes_moved() // n // 4
    send, recv = np.ones(size, np.float32), np.empty(size, np.float32)
    part = size // (n - 1)
    floors = {"ring": [], "all_to_all": [], "copy": []}
    # and the local copies the reshard also does (a rank's own overlap of source and target), as
    # one contiguous memcpy of the same bytes
    copied = sum(
        int(np.prod(m.plan.copy_box[i, :, 1] - m.plan.copy_box[i, :, 0])) * 4
        for m in mp.moves
        for i in np.flatnonzero(m.plan.ranks[m.plan.copy_id] == me)
    )
    a, b = np.ones(copied // 4, np.float32), np.empty(copied // 4, np.float32)
    for _ in range(repeats):
        floors["copy"].append(_timed(lambda: np.copyto(b, a)))
        group.barrier()
        t0 = time.perf_counter()
        for work in group.batch_isend_irecv([P2POp("send", send, (me + 1) % n), P2POp("recv", recv, (me - 1) % n)]):
            work.wait()
        group.barrier()
        floors["ring"].append(time.perf_counter() - t0)
        ops = []
        for k, peer in enumerate(q for q in range(n) if q != me):
            piece = slice(k * part, (k + 1) * part)
            ops += [P2POp("send", send[piece], peer), P2POp("recv", recv[piece], peer)]
        group.barrier()
        t0 = time.perf_counter()
        for work in group.batch_isend_irecv(ops):
            work.wait()
        group.barrier()
        floors["all_to_all"].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in (times | floors).items()} | {"ok": ok, "copied": copied}


def out_specs(dst, me):
    return [(n, s) for n, s in dst.items() if me in s.layout.ranks]


def _expected(name, spec, weights, rank):
    """Reference shard: a fused parameter holds its parts' shards side by side."""
    if name in weights:
        return weights[name][spec.layout.global_slice(spec.shape, rank)]
    prefix, module, _ = name.rsplit(".", 2)
    rule = next(r for r in DEFAULT_FUSIONS if r.fused == module)
    parts = [weights[f"{prefix}.{p}.weight"] for p in rule.parts]
    return np.concatenate([w[spec.layout.global_slice(w.shape, rank)] for w in parts])


def bench_online(repeats: int, nprocs_list=(2, 4)) -> list[dict]:
    from ms_layout.comm import run_local

    rows = []
    for nprocs in nprocs_list:
        results = run_local(online_rank, nprocs=nprocs, backend="gloo", timeout=300, args=(repeats,))
        _, _, _, mp = online_plan(nprocs)
        moved = mp.bytes_moved()
        if not all(r["ok"] for r in results):
            raise SystemExit("online reshard gave wrong shards")
        slowest = {k: max(r[k] for r in results) for k in ("per_tensor", "bucketed", "ring", "all_to_all", "copy")}
        # baseline: one process copying the same number of bytes (piece by piece would only be slower)
        a = np.ones(moved // 4, np.float32)
        b = np.empty_like(a)
        memcpy = min(_timed(lambda a=a, b=b: np.copyto(b, a)) for _ in range(5))
        train, serve = ONLINE[nprocs]
        for mode in ("per_tensor", "bucketed"):
            seconds = slowest[mode]
            rows.append(
                {
                    "section": "online",
                    "case": f"Llama h512 x4 layers, {_short(train)} -> {_short(serve)} fused, {nprocs} gloo ranks, "
                    f"{mode.replace('_', ' ')}",
                    "moved_MB": round(moved / MB, 1),
                    "lower_bound_MB": round(mp.lower_bound_total() / MB, 1),
                    "copied_MB_per_rank": round(max(r["copied"] for r in results) / MB, 1),
                    "seconds": round(seconds, 4),
                    "GB/s": round(moved / seconds / GB, 3),
                    "memcpy_GB/s": round(moved / memcpy / GB, 3),
                    "reshard/memcpy_time": round(seconds / memcpy, 1),
                    "gloo_ring_GB/s": round(moved / slowest["ring"] / GB, 3),
                    "reshard/gloo_ring_time": round(seconds / slowest["ring"], 2),
                    "reshard/all_to_all_time": round(seconds / slowest["all_to_all"], 2),
                    "reshard/(all_to_all+copy)_time": round(seconds / (slowest["all_to_all"] + slowest["copy"]), 2),
                }
            )
    return rows


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------- output
def print_rows(rows: list[dict]) -> None:
    sections: dict[str, list[dict]] = {}
    for row in rows:
        sections.setdefault(row["section"], []).append(row)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    for name, group in sections.items():
        cols = [c for c in group[0] if c != "section"]
        if Console is None:
            print(f"\n[{name}]")
            for row in group:
                print("  " + "  ".join(f"{c}={row[c]}" for c in cols))
            continue
        table = Table(title=name)
        for c in cols:
            table.add_column(c)
        for row in group:
            table.add_row(*[str(row[c]) for c in cols])
        Console(width=220).print(table)


def planning_row(world: int, layers: int, config: str) -> dict:
    """bench_planning in a fresh process, so that its peak RSS is its own."""
    cmd = [sys.executable, os.path.abspath(__file__), "--row", f"{world},{layers},{config}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=os.path.dirname(__file__))
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(rows: list[dict], old: dict) -> dict:
    """The headline figures: the tp8 config's plan seconds and peak RSS, moved bytes / lower bound."""
    out = dict(old)
    for row in rows:
        if row["section"] == "planning" and row["case"].endswith("tp8") and " 61 layers" in row["case"]:
            world = row["case"].split(", ")[1].split()[0]
            out[f"plan_s_{world}"] = row["plan_s"]
            out[f"layouts_s_{world}"] = row["layouts_s"]
            out[f"peak_rss_gb_{world}"] = row["peak_rss_GB"]
    ratios = [r["moved/lower_bound"] for r in rows if r["section"] == "planning"]
    if ratios:
        out["moved_over_lower_bound"] = max(ratios)
    for row in rows:  # the online executor against one all-to-all of the same bytes
        if row["section"] == "online" and row["case"].endswith("bucketed"):
            n = row["case"].split(" gloo ranks")[0].rsplit(" ", 1)[1]
            out[f"online_over_all_to_all_{n}"] = row["reshard/all_to_all_time"]
            out[f"online_over_all_to_all_plus_copy_{n}"] = row["reshard/(all_to_all+copy)_time"]
    return out


def write(path: str, rows: list[dict], full: bool, replace: frozenset[str] | set[str] = frozenset()) -> None:
    """Write `rows` into the JSON at `path`; unless `full`, the other rows stay (a partial run
    replaces its own cases, the sections in `replace` whole, and the planning rows written before
    the configs were named)."""
    old: dict = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    cases = {(r["section"], r["case"]) for r in rows}
    kept = [
        r
        for r in ([] if full else old.get("rows", []))
        if (r["section"], r["case"]) not in cases
        and r["section"] not in replace
        and not (r["section"] == "planning" and not r["case"].endswith(tuple(CONFIGS)))
    ]
    result = {
        "benchmark": "reshard",
        "title": "ms-reshard: planning at DeepSeek-V3 scale, bytes against MindSpore, online throughput",
        "machine": machine_info("mindspore"),
        "summary": summary(kept + rows, old.get("summary", {})),
        "rows": sorted(kept + rows, key=lambda r: ["planning", "bytes", "online"].index(r["section"])),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1024 ranks and 16 layers only, fewer repeats")
    parser.add_argument("--planning-only", action="store_true", help="run section 1 (planning) alone")
    parser.add_argument("--online-only", action="store_true", help="run section 3 (online) alone")
    parser.add_argument("--ranks", type=int, action="append", choices=sorted(SCALES), help="planning at N ranks only")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # world,layers,config: one planning row as JSON
    parser.add_argument("--out", default="benchmarks/results/reshard.json")
    args = parser.parse_args(argv)
    if args.row:
        world, layers, config = args.row.split(",")
        print(json.dumps(bench_planning(int(world), int(layers), config)))
        return 0
    rows = []
    if args.online_only:
        rows = bench_online(repeats=2 if args.quick else 5)
        print_rows(rows)
        write(args.out, rows, full=False, replace={"online"})
        return 0
    worlds = args.ranks or sorted(SCALES)
    scales = [(1024, 16)] if args.quick else [(w, 61) for w in worlds]
    configs = ["tp8"] if args.quick or args.ranks else ["tp8", "no-tp"]
    for config in configs:
        for world, layers in scales:
            rows.append(planning_row(world, layers, config))
            print(rows[-1], file=sys.stderr)
    if not (args.planning_only or args.ranks):
        rows += bench_bytes()
        rows += bench_online(repeats=2 if args.quick else 5)
    print_rows(rows)
    write(args.out, rows, full=not (args.planning_only or args.ranks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
