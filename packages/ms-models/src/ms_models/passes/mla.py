"""Explicit passes of Multi-head Latent Attention (``ms_models.mla.MLAttention``, training form).

The forward is ``MLAttention.construct`` (the latent expanded into per-head keys and values)::

    q          = q_b(norm_q(q_a(x)))   or q_proj(x)            [.., H, nope | rope]
    c, k_pe    = split(kv_a(x))                                 [.., rank], [.., rope]
    k_nope, v  = split(kv_b(norm_kv(c)))                        [.., H, nope], [.., H, v]
    q, k       = [q_nope | rope(q_pe)], [k_nope | rope(k_pe)]   (k_pe shared by every head)
    y          = o(attention(q, k, v))

Saved by the forward: the input x, the two norms' outputs with their normed values and 1 / rms
(the inputs of q_b and kv_b, and what RMSNorm's backward needs), the attention output (o_proj's
input) and the attention core's (q, k, v, probs). The backward walks the chain in reverse: o_proj,
the attention core, the inverse RoPE rotations, and, since k_pe is broadcast over heads, its
gradient summed over heads; both projection paths' input gradients add up in dx. Each projection's
(input, output gradient) pair is kept for the W pass, and each norm's (normed, output gradient)
pair for its scale gradient.
"""

from __future__ import annotations

from mindspore import nn, ops

from . import ops as P
from .dense import _linear, _linear_grads, _linear_weights


class MLAPasses(nn.Cell):
    """Passes of ``MLAttention`` (q_lora_rank set or None, interleaved RoPE or not, optional biases):
    forward(h, cos, sin, allowed), backward_input(saved, g, cos, sin), backward_weight(pairs)."""

    def __init__(self, attn):
        super().__init__(auto_prefix=False)
        self.attn = attn
        self.num_heads, self.rank = attn.num_heads, attn.rank
        self.nope, self.rope, self.v_dim = attn.nope, attn.rope, attn.v_dim
        self.q_head_dim, self.scale = attn.q_head_dim, attn.scale
        self.interleave, self.q_lora = attn.interleave, attn.q_lora

    def weights(self) -> list:
        a = self.attn
        if self.q_lora:
            q = [*_linear_weights(a.q_a_proj), a.q_a_layernorm.weight, *_linear_weights(a.q_b_proj)]
        else:
            q = _linear_weights(a.q_proj)
        kv = [*_linear_weights(a.kv_a_proj_with_mqa), a.kv_a_layernorm.weight, *_linear_weights(a.kv_b_proj)]
        return q + kv + _linear_weights(a.o_proj)

    def forward(self, h, cos, sin, allowed):
        a = self.attn
        b, s = h.shape[0], h.shape[1]
        if self.q_lora:
            qy, qn, qr = P.rms_norm(_linear(h, a.q_a_proj), a.q_a_layernorm.weight, a.q_a_layernorm.eps)
            q = _linear(qy, a.q_b_proj)
            s_q = (qy, qn, qr)
        else:
            q = _linear(h, a.q_proj)
            s_q = ()
        q = q.reshape(b, s, self.num_heads, self.q_head_dim)
        q_pe = P.rope(q[..., self.nope :], cos, sin, self.interleave)
        q = ops.cat((q[..., : self.nope], q_pe), -1)
        kv = _linear(h, a.kv_a_proj_with_mqa)
        cy, cn, cr = P.rms_norm(kv[..., : self.rank], a.kv_a_layernorm.weight, a.kv_a_layernorm.eps)
        k_pe = P.rope(kv[..., self.rank :].reshape(b, s, 1, self.rope), cos, sin, self.interleave)
        kvb = _linear(cy, a.kv_b_proj).reshape(b, s, self.num_heads, self.nope + self.v_dim)
        k_pe = ops.broadcast_to(k_pe, (b, s, self.num_heads, self.rope))
        k = ops.cat((kvb[..., : self.nope], k_pe), -1)
        o, core = P.attention(q, k, kvb[..., self.nope :], allowed, self.scale)
        return _linear(o, a.o_proj), (h, s_q, (cy, cn, cr), o, core)

    def backward_input(self, saved, g, cos, sin):
        a = self.attn
        h, s_q, s_c, o, core = saved
        b, s = h.shape[0], h.shape[1]
        dq, dk, dv = P.attention_dx(P.linear_dx(g, a.o_proj.weight), core, self.scale, self.num_heads)
        dq_pe = P.rope_dx(dq[..., self.nope :], cos, sin, self.interleave)
        dq = ops.cat((dq[..., : self.nope], dq_pe), -1).reshape(b, s, -1)  # q projection's output gradient
        # k_pe was broadcast over heads: its gradient is the sum over heads, then un-rotated
        dk_pe = P.rope_dx(dk[..., self.nope :].sum(2, keepdims=True), cos, sin, self.interleave)
        dkvb = ops.cat((dk[..., : self.nope], dv), -1).reshape(b, s, -1)  # kv_b's output gradient
        cy, cn, cr = s_c
        dcy = P.linear_dx(dkvb, a.kv_b_proj.weight)
        dc = P.rms_norm_dx(dcy, a.kv_a_layernorm.weight, cn, cr)
        dkv = ops.cat((dc, dk_pe.reshape(b, s, self.rope)), -1)  # kv_a's output gradient
        dh = P.linear_dx(dkv, a.kv_a_proj_with_mqa.weight)
        if self.q_lora:
            qy, qn, qr = s_q
            dqy = P.linear_dx(dq, a.q_b_proj.weight)
            dqa = P.rms_norm_dx(dqy, a.q_a_layernorm.weight, qn, qr)
            dh = dh + P.linear_dx(dqa, a.q_a_proj.weight)
            w_q = (qy, qn, dqy, dqa, dq)
        else:
            dh = dh + P.linear_dx(dq, a.q_proj.weight)
            w_q = (dq,)
        return dh, (h, w_q, cy, cn, dcy, dkvb, dkv, o, g)

    def backward_weight(self, pairs, k=P):
        a = self.attn
        h, w_q, cy, cn, dcy, dkvb, dkv, o, g = pairs
        if self.q_lora:
            qy, qn, dqy, dqa, dq = w_q
            grads = _linear_grads(a.q_a_proj, h, dqa, k) + (k.scale_dw(qn, dqy),) + _linear_grads(a.q_b_proj, qy, dq, k)
        else:
            grads = _linear_grads(a.q_proj, h, w_q[0], k)
        return (
            grads
            + _linear_grads(a.kv_a_proj_with_mqa, h, dkv, k)
            + (k.scale_dw(cn, dcy),)
            + _linear_grads(a.kv_b_proj, cy, dkvb, k)
            + _linear_grads(a.o_proj, o, g, k)
        )


__all__ = ["MLAPasses"]
