"""bench_reshard section 1: planning DeepSeek-V3 (with its MTP layer) at 1024 and 4096 ranks.

The whole parameter list (61 decoder layers and the MTP layer, 256 routed experts, MLA, hidden
7168; 46k names synthesized with HF names and shapes) from a training config (tp=8, pp=16, ep=32
with optimizer sharding; and the earlier pp=16, ep=64 without tp) to a serving config (tp=8,
ep=128/256): seconds to derive the layouts (ms_reshard.param_specs over ms_layout.param_placement)
and to plan, peak RSS of the planning process (each row runs in its own process), distinct plans,
bytes moved against the lower bound and against gathering everything then slicing.
"""

from __future__ import annotations

import gc
import json
import math
import os
import resource
import subprocess
import sys
import time

from ms_layout import ParallelConfig
from ms_reshard import PlanCache, model_plan, param_specs
from ms_reshard.plan import naive_gather_bytes

GB = 1e9


def deepseek_v3_shapes(layers: int = 61, dense: int = 3, experts: int = 256, mtp: int = 1) -> dict[str, tuple]:
    """HF names and shapes of DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3), with its `mtp`
    multi-token-prediction layers numbered after the decoder (num_nextn_predict_layers=1: layer 61)."""
    hidden, vocab, inter, moe_inter = 7168, 129280, 18432, 2048
    heads, q_rank, kv_rank, nope, rope, v_dim = 128, 1536, 512, 128, 64, 128
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers + mtp):
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
        if i >= layers:  # MTP: its own embedding, norms, projection and head around a MoE layer
            s |= {p + "embed_tokens.weight": (vocab, hidden), p + "shared_head.head.weight": (vocab, hidden)}
            s |= {p + n: (hidden,) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
            s[p + "eh_proj.weight"] = (hidden, 2 * hidden)
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


def short(c: ParallelConfig) -> str:
    """ "tp8 pp16 dp8 ep8 +ZeRO": the sizes that are not 1."""
    sizes = " ".join(f"{k}{getattr(c, k)}" for k in ("tp", "pp", "dp", "ep") if getattr(c, k) > 1)
    return sizes + (" +ZeRO" if c.optimizer_shard else "")


def bench_planning(world: int, layers: int, config: str = "tp8", repeats: int = 3) -> dict:
    """Layouts and plan of the whole model, each from scratch `repeats` times (the best time is
    reported: the benchmark machine is shared)."""
    train, infer = CONFIGS[config][world]
    shapes = deepseek_v3_shapes(layers)
    # 61 layers on 16 stages: three stages of 3 layers, thirteen of 4 (fewer where embed/head sit);
    # the MTP layer sits on the last stage with the head
    per_chunk = [3, 3, 3] + [4] * 13 if layers == 61 else None
    layouts_s = plan_s = total_s = math.inf
    load = os.getloadavg()[0]
    for _ in range(repeats):
        src = dst = mp = cache = None  # the previous repeat's plans are garbage before this one's peak
        gc.collect()  # and collected outside the timing
        t0 = time.perf_counter()
        src = param_specs(shapes, train, layers, 256, dtype="bfloat16", layers_per_chunk=per_chunk)
        dst = param_specs(shapes, infer, layers, 256, dtype="bfloat16")
        t1 = time.perf_counter()
        cache = PlanCache()
        mp = model_plan(src, dst, cache=cache)
        t2 = time.perf_counter()
        layouts_s, plan_s, total_s = min(layouts_s, t1 - t0), min(plan_s, t2 - t1), min(total_s, t2 - t0)
    moved, lower = mp.bytes_moved(), mp.lower_bound_total()
    naive = sum(naive_gather_bytes(m.plan) for m in mp.moves)
    multicasts = sum(len(p.multicast) for p in cache.canonical.values() if p.multicast is not None)
    return {
        "section": "planning",
        "case": f"DeepSeek-V3 {layers} layers + MTP, {world} ranks, {config}",
        "train": short(train),
        "serve": short(infer),
        "params": len(shapes),
        "layouts_s": round(layouts_s, 2),
        "plan_s": round(plan_s, 2),
        "layouts+plan_s": round(total_s, 2),
        "peak_rss_GB": round(peak_rss_gb(), 2),
        "load_avg_1m": round((load + os.getloadavg()[0]) / 2, 2),
        "plans_computed": cache.computed,
        "multicast_rows": multicasts,
        "plans_reused": len(mp.moves) - cache.computed,
        "moved_GB": round(moved / GB, 1),
        "lower_bound_GB": round(lower / GB, 1),
        "naive_GB": round(naive / GB, 1),
        "moved/lower_bound": round(moved / lower, 4),
        "naive/moved": round(naive / moved, 2),
    }


def planning_row(world: int, layers: int, config: str) -> dict:
    """bench_planning in a fresh process, so that its peak RSS is its own."""
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, os.path.join(here, "_reshard_planning.py"), f"{world},{layers},{config}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=here)
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # one row as JSON: world,layers,config
    world, layers, config = sys.argv[1].split(",")
    print(json.dumps(bench_planning(int(world), int(layers), config)))
