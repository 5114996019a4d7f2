"""Grouped-query attention (Llama/Qwen2) with a training path and a paged-KV-cache path.

Training: [batch, seq] tokens with a boolean mask (causal, optionally block-diagonal for packed
samples). Paged: a flat batch of tokens from many sequences (prefills and decodes mixed), whose
keys and values are first written into the block cache and then read back through each
sequence's block table, so that a decode step sees exactly what the prefill wrote.
"""

from __future__ import annotations

from mindspore import dtype as mstype
from mindspore import nn, ops

from .layers import Linear, apply_rope, attention_probs
from .paged_cache import PagedMetadata, allowed_mask, from_padded, gather_context, to_padded, write_cache


def attend(q, k, v, allowed, scale: float):
    """Softmax attention. q [N, Sq, Hq, d], k [N, Sk, Hkv, d], v [N, Sk, Hkv, dv], allowed [N, 1, Sq, Sk]
    (bool) -> [N, Sq, Hq * dv]. Hq is a multiple of Hkv (GQA; MLA's absorbed path has Hkv = 1)."""
    n, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    groups = hq // hkv
    # Queries of one kv group share its key: fold the group into the query axis so one batched
    # matmul per kv head does the work, without repeating k and v.
    q = q.reshape(n, sq, hkv, groups, d).transpose(0, 2, 3, 1, 4).reshape(n, hkv, groups * sq, d)
    scores = ops.matmul(q.astype(mstype.float32), k.transpose(0, 2, 3, 1).astype(mstype.float32)) * scale
    scores = scores.reshape(n, hkv, groups, sq, sk)
    probs = attention_probs(scores, allowed.expand_dims(1)).astype(v.dtype).reshape(n, hkv, groups * sq, sk)
    out = ops.matmul(probs, v.transpose(0, 2, 1, 3)).reshape(n, hkv, groups, sq, dv)
    return out.transpose(0, 3, 1, 2, 4).reshape(n, sq, hq * dv)


_scores = ops.BatchMatMul(transpose_b=True)
_weighted = ops.BatchMatMul()


def attend_head_major(q, k, v, allowed, scale: float):
    """attend() with head-major keys and values: k [Hkv, N, Sk, d], v [Hkv, N, Sk, dv] (as a flat
    paged cache gathers them) -> [N, Sq, Hq * dv]. The batched matmuls read k and v where they lie;
    only the queries and the output (Sk times smaller than k and v in a decode step) are moved."""
    n, sq, hq, d = q.shape
    hkv, sk, dv = k.shape[0], k.shape[2], v.shape[-1]
    groups = hq // hkv
    q = q.reshape(n, sq, hkv, groups, d).transpose(2, 0, 3, 1, 4).reshape(hkv, n, groups * sq, d)
    scores = _scores(q.astype(mstype.float32), k.astype(mstype.float32)) * scale
    scores = scores.reshape(hkv, n, groups, sq, sk)
    probs = attention_probs(scores, allowed.expand_dims(0)).astype(v.dtype).reshape(hkv, n, groups * sq, sk)
    out = _weighted(probs, v).reshape(hkv, n, groups, sq, dv)
    return out.transpose(1, 3, 0, 2, 4).reshape(n, sq, hq * dv)


class Attention(nn.Cell):
    """q/k/v/o projections (HF names), RoPE, softmax attention; num_key_value_heads groups of queries."""

    def __init__(self, config, rng=None):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = self.head_dim**-0.5
        std = c.initializer_range
        self.q_proj = Linear(c.hidden_size, self.num_heads * self.head_dim, c.qkv_bias, std, rng)
        self.k_proj = Linear(c.hidden_size, self.num_kv_heads * self.head_dim, c.qkv_bias, std, rng)
        self.v_proj = Linear(c.hidden_size, self.num_kv_heads * self.head_dim, c.qkv_bias, std, rng)
        self.o_proj = Linear(self.num_heads * self.head_dim, c.hidden_size, c.o_bias, std, rng)

    def cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], ...]:
        """Shapes of this layer's paged cache: keys and values, [blocks, block_size, kv_heads, head_dim]."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return (shape, shape)

    def _qkv(self, x, cos, sin):
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(
            lead
            + (
                self.num_heads,
                self.head_dim,
            )
        )
        k = self.k_proj(x).reshape(
            lead
            + (
                self.num_kv_heads,
                self.head_dim,
            )
        )
        v = self.v_proj(x).reshape(
            lead
            + (
                self.num_kv_heads,
                self.head_dim,
            )
        )
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def construct(self, x, cos, sin, allowed):
        """Training forward: x [B, S, hidden], cos/sin [B, S, d/2], allowed [B, 1, S, S]."""
        q, k, v = self._qkv(x, cos, sin)
        return self.o_proj(attend(q, k, v, allowed, self.scale))

    def forward_paged(self, x, cos, sin, cache, meta: PagedMetadata):
        """Inference over a flat token batch: x [T, hidden]; cache = (k_cache, v_cache), each
        [num_blocks, block_size, kv_heads, head_dim] (or slot-major [num_blocks * block_size, kv_heads,
        head_dim]) or flat, head-major [kv_heads * slots, head_dim] (allocate_kv_caches(flat=True)),
        updated in place with this batch's keys/values."""
        q, k, v = self._qkv(x, cos, sin)
        k_cache, v_cache = cache
        write_cache(k_cache, k, meta, k_cache.ndim == 2)
        write_cache(v_cache, v, meta, v_cache.ndim == 2)
        if k_cache.ndim == 2:
            heads = self.num_kv_heads
            k_ctx, v_ctx = gather_context(k_cache, meta, True, heads), gather_context(v_cache, meta, True, heads)
            out = attend_head_major(to_padded(q, meta), k_ctx, v_ctx, allowed_mask(meta), self.scale)
        else:
            k_ctx, v_ctx = gather_context(k_cache, meta), gather_context(v_cache, meta)
            out = attend(to_padded(q, meta), k_ctx, v_ctx, allowed_mask(meta), self.scale)
        return self.o_proj(from_padded(out, meta))
