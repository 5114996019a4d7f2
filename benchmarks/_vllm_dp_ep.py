"""DP attention + EP against TP on 2 processes: `vllm serve` on a DeepSeek-V3 of hidden 256, the same
mixed-length 64-request load from `vllm bench serve`, the two servers alternated.

    TP2       --tensor-parallel-size 2 --enable-expert-parallel: one engine, 2 workers; attention
              heads split, the MLA latent cache replicated on both, routed experts EP=2 over the same
              ranks; 2 all-reduces per layer
    DP2+EP2   --data-parallel-size 2 --enable-expert-parallel: 2 engines with their own requests and
              latent caches; attention whole per rank; routed experts EP=2, tokens exchanged by
              all-to-all (two per MoE layer, plus a count all-gather)

Each rank gets one MindSpore thread (2 cores, 2 ranks). Reported: output tokens/s, TPOT p50/p99 and
TTFT from `vllm bench serve`, and DP rank 0's / TP rank 0's latent cache: the most KV blocks its
requests held at once times the bytes of a block (vLLM's dev /collective_rpc, rank 0 only).
"""

from __future__ import annotations

import json
import os
import tempfile

from _vllm_serve import METRICS, Server

MODEL = dict(
    vocab_size=4096, hidden_size=256, num_attention_heads=4, num_key_value_heads=4, intermediate_size=512,
    num_hidden_layers=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
    v_head_dim=64, moe_intermediate_size=256, n_routed_experts=8, n_group=4, topk_group=2,
    num_experts_per_tok=2, num_nextn_predict_layers=0,
)  # fmt: skip
BUCKETS = {"decode_sizes": [1, 2, 4, 8, 16, 32], "prefill_sizes": [16, 64, 256], "context_sizes": [256],
           "batch_tokens": 256}  # fmt: skip
VARIANTS = {
    "TP2": ["--tensor-parallel-size", "2", "--enable-expert-parallel"],
    "DP2+EP2": ["--data-parallel-size", "2", "--enable-expert-parallel", "--api-server-count", "1"],
}


def _rank0(base: str, method: str) -> dict:
    import requests

    r = requests.post(base + "/collective_rpc", json={"method": method}, timeout=120)
    r.raise_for_status()
    return r.json()["results"][0]


def dp_ep(root: str, num_prompts: int = 64, concurrency: int = 32, rounds: int = 2) -> dict:
    """Figures of both variants, `rounds` times each, alternated (the first round warms the compile cache)."""
    import ms_models

    path = ms_models.make_tiny("deepseek_v3", os.path.join(root, "dsv3-256"), seed=0, **MODEL)
    out_dir = tempfile.mkdtemp(prefix="ms-vllm-dpep-", dir=root)
    caches = {v: tempfile.mkdtemp(prefix=f"cc-{v}-", dir=root) for v in VARIANTS}
    env = {"VLLM_SERVER_DEV_MODE": "1", "MS_VLLM_THREADS": "1"}
    extra_common = ["--additional-config", json.dumps({"compile": BUCKETS})]
    runs: dict = {v: [] for v in VARIANTS}
    raw: dict = {v: [] for v in VARIANTS}
    for k in range(rounds):
        for name, args in VARIANTS.items():
            tag = f"{name.replace('+', '-')}-{k}"
            server = Server(path, os.path.join(out_dir, f"{tag}.log"), caches[name], False, concurrency,
                            extra=(*args, *extra_common), env=env)  # fmt: skip
            try:
                top = server.bench(out_dir, tag, num_prompts, float("inf"), concurrency)
                stats, shard = _rank0(server.base, "ms_vllm_stats"), _rank0(server.base, "ms_vllm_shard_info")
            finally:
                server.close()
            fig = {
                "start_s": round(server.start_s, 1),
                "output_tok_s": round(top["output_throughput"], 2),
                "request_throughput": round(top["request_throughput"], 3),
                **{f"{m}_{q}_ms": round(top[f"{q}_{m}_ms"], 2) for m in METRICS for q in ("p50", "p99")},
                "rank0_peak_kv_blocks": stats["peak_kv_blocks"],
                "rank0_latent_bytes": stats["peak_kv_blocks"] * shard["kv_bytes_per_block"],
                "rank0_tokens": stats["tokens"],
                "rank0_dummy_forwards": stats["dummy_forwards"],
                "rank0_exchange": stats.get("exchange"),
                "rank0_params": shard["params"],
            }
            runs[name].append(fig)
            raw[name].append(top)
    best = {v: max(r, key=lambda f: f["output_tok_s"]) for v, r in runs.items()}
    tp, dp = best["TP2"], best["DP2+EP2"]
    summary = {
        "dp_ep_over_tp_output_tok_s": round(dp["output_tok_s"] / tp["output_tok_s"], 3),
        "dp_ep_over_tp_tpot_p50": round(dp["tpot_p50_ms"] / tp["tpot_p50_ms"], 3),
        "dp_ep_over_tp_rank0_latent_bytes": round(dp["rank0_latent_bytes"] / tp["rank0_latent_bytes"], 3),
        "tp2_output_tok_s": tp["output_tok_s"],
        "dp2_ep2_output_tok_s": dp["output_tok_s"],
    }
    load = dict(num_prompts=num_prompts, max_concurrency=concurrency, request_rate="inf")
    return {"model": MODEL, "load": load, "runs": runs, "best": best, "summary": summary, "raw": raw}


def dp_ep_rows(result: dict) -> list[dict]:
    rows = []
    for name, r in result["best"].items():
        rows.append(
            dict(
                case=f"DeepSeek-V3 h256: vllm serve {name}, {result['load']['num_prompts']} mixed requests",
                ours=f"{r['output_tok_s']:.1f} out tok/s, TPOT p50/p99 "
                f"{r['tpot_p50_ms']:.1f}/{r['tpot_p99_ms']:.1f} ms",
                baseline=f"rank 0 latent cache peak {r['rank0_latent_bytes'] / 2**20:.2f} MiB",
                variant=name,
                **r,
            )
        )
    return rows


__all__ = ["dp_ep", "dp_ep_rows"]
