"""Multi-head Latent Attention (DeepSeek-V2/V3), HF module names.

    q        = q_b_proj(q_a_layernorm(q_a_proj(x)))            per head [nope | rope]
    c, k_pe  = split(kv_a_proj_with_mqa(x))                    latent [kv_lora_rank], key [rope]
    c        = kv_a_layernorm(c)
    k_nope, v = split(kv_b_proj(c))                            per head [nope | v_head_dim]
    k        = [k_nope | rope(k_pe)], shared k_pe across heads

Training expands the latent into per-head keys and values (the "naive" form). The paged path caches
only [c | rope(k_pe)] per token (kv_lora_rank + qk_rope_head_dim values, not heads x (k + v)) and uses
the absorbed form of DeepSeek-V2 sec. 2.1.2: W_UK (the k_nope rows of kv_b_proj) is folded into the
query, attention runs over the latent as a single shared key/value head, and W_UV (the v rows) is
applied to the attended latent. Both forms give the same logits.
"""

from __future__ import annotations

from mindspore import nn, ops

from .attention import attend
from .layers import Linear, RMSNorm, apply_rope, stacked_linear
from .paged_cache import PagedMetadata, allowed_mask, from_padded, gather_context, to_padded, write_cache


class MLAttention(nn.Cell):
    """DeepSeek-V3 attention: low-rank q, compressed KV latent, decoupled RoPE key."""

    def __init__(self, config, rng=None):
        super().__init__()
        c = config
        std, bias = c.initializer_range, c.attention_bias
        self.num_heads, self.rank = c.num_attention_heads, c.kv_lora_rank
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.q_head_dim = self.nope + self.rope
        self.scale = c.softmax_scale()
        self.interleave = bool(c.rope_interleave)
        self.q_lora = c.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias, std, rng)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = Linear(c.q_lora_rank, self.num_heads * self.q_head_dim, False, std, rng)
        else:
            self.q_proj = Linear(c.hidden_size, self.num_heads * self.q_head_dim, False, std, rng)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, self.rank + self.rope, bias, std, rng)
        self.kv_a_layernorm = RMSNorm(self.rank, c.rms_norm_eps)
        self.kv_b_proj = Linear(self.rank, self.num_heads * (self.nope + self.v_dim), False, std, rng)
        self.o_proj = Linear(self.num_heads * self.v_dim, c.hidden_size, bias, std, rng)

    def cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], ...]:
        """One cache per layer: [blocks, block_size, kv_lora_rank + qk_rope_head_dim] (latent | rope key)."""
        return ((num_blocks, block_size, self.rank + self.rope),)

    def _project(self, x, cos, sin):
        """-> q_nope [.., H, nope], q_pe [.., H, rope] (rotated), latent [.., rank] (normed), k_pe [.., 1, rope]."""
        lead = x.shape[:-1]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.reshape(
            lead
            + (
                self.num_heads,
                self.q_head_dim,
            )
        )
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[..., : self.rank])
        k_pe = kv[..., self.rank :].reshape(
            lead
            + (
                1,
                self.rope,
            )
        )
        q_pe = apply_rope(q_pe, cos, sin, self.interleave)
        k_pe = apply_rope(k_pe, cos, sin, self.interleave)
        return q_nope, q_pe, latent, k_pe

    def construct(self, x, cos, sin, allowed):
        """Training forward (latent expanded per head): x [B, S, H] -> [B, S, H]."""
        q_nope, q_pe, latent, k_pe = self._project(x, cos, sin)
        lead = x.shape[:-1]
        kv = self.kv_b_proj(latent).reshape(
            lead
            + (
                self.num_heads,
                self.nope + self.v_dim,
            )
        )
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        k_pe = ops.broadcast_to(k_pe, lead + (self.num_heads, self.rope))
        q = ops.cat((q_nope, q_pe), -1)
        k = ops.cat((k_nope, k_pe), -1)
        return self.o_proj(attend(q, k, v, allowed, self.scale))

    def _absorbed_weights(self):
        w = self.kv_b_proj.weight.reshape(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope, :], w[:, self.nope :, :]  # W_UK [H, nope, rank], W_UV [H, v, rank]

    def forward_paged(self, x, cos, sin, cache, meta: PagedMetadata):
        """Absorbed MLA over a flat token batch x [T, H]; the cache [blocks, block_size, rank + rope]
        is written in place."""
        q_nope, q_pe, latent, k_pe = self._project(x, cos, sin)
        flat = cache.ndim == 2  # slot-major [slots, rank + rope] (allocate_kv_caches(flat=True))
        write_cache(cache, ops.cat((latent, k_pe[:, 0, :]), -1), meta, flat)
        w_uk, w_uv = self._absorbed_weights()
        # q_nope . (W_UK c) = (W_UK^T q_nope) . c: move the query into latent space, per head.
        q_latent = ops.matmul(q_nope.transpose(1, 0, 2), w_uk).transpose(1, 0, 2)  # [T, H, rank]
        q = to_padded(ops.cat((q_latent, q_pe), -1), meta)  # [N, Q, H, rank + rope]
        ctx = gather_context(cache, meta, flat).expand_dims(2)  # [N, C, 1, rank + rope]: one shared kv head
        out = attend(q, ctx, ctx[..., : self.rank], allowed_mask(meta), self.scale)  # [N, Q, H * rank]
        out = from_padded(out, meta).reshape(-1, self.num_heads, self.rank)
        # sum_j p_j (W_UV c_j) = W_UV (sum_j p_j c_j): expand the attended latent to values.
        out = stacked_linear(out.transpose(1, 0, 2), w_uv).transpose(1, 0, 2)  # [T, H, v]
        return self.o_proj(out.reshape(-1, self.num_heads * self.v_dim))
