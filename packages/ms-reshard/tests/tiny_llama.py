"""Synthetic Hugging Face names and shapes of a tiny Llama-like model (GQA, SwiGLU, untied head)."""

from __future__ import annotations

import numpy as np

from ms_reshard.fusion import split_name

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 16, 4, 2, 4, 32, 64


def llama_shapes(layers: int = 2) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (HIDDEN,),
                p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                p + "post_attention_layernorm.weight": (HIDDEN,),
                p + "mlp.gate_proj.weight": (INTER, HIDDEN),
                p + "mlp.up_proj.weight": (INTER, HIDDEN),
                p + "mlp.down_proj.weight": (HIDDEN, INTER),
            }
        )
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def random_weights(shapes, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def expected_shard(name: str, spec, weights, fusions, rank: int) -> np.ndarray:
    """Reference target shard: a fused parameter is the per-rank concatenation of its parts' shards
    (what vLLM's QKVParallelLinear holds); anything else is a plain slice of the global weight."""
    if name in weights:
        return weights[name][spec.layout.global_slice(spec.shape, rank)]
    prefix, module, leaf = split_name(name)
    rule = next(r for r in fusions if r.fused == module)
    parts = [weights[f"{prefix}{p}.{leaf}"] for p in rule.parts]
    return np.concatenate([w[spec.layout.global_slice(w.shape, rank)] for w in parts], axis=rule.dim)
