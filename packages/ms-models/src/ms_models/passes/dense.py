"""Explicit passes of the dense sublayers: GQA attention with RoPE and the SwiGLU MLP.

Each passes Cell wraps the model's own sublayer (its Parameters, not copies) and has three
methods, all jit-compilable:

* ``forward(...) -> (y, saved)``: the sublayer's output and every value its backward needs;
* ``backward_input(saved, g, ...) -> (dx, pairs)``: the input gradient, computed from ``saved``
  without re-running the forward, and for each weight what W needs (its input and output
  gradient);
* ``backward_weight(pairs, k=ops) -> grads``: the weight gradients, in the order of ``weights()``,
  computed with the kernels ``k`` (:mod:`.ops` in a graph, :mod:`.host_ops` on numpy pairs).
"""

from __future__ import annotations

from mindspore import nn

from . import ops as P


def _linear(x, cell):
    y = P.linear(x, cell.weight)
    return y if cell.bias is None else y + cell.bias


def _linear_weights(cell) -> list:
    return [cell.weight] if cell.bias is None else [cell.weight, cell.bias]


def _linear_grads(cell, x, g, k) -> tuple:
    if cell.bias is None:
        return (k.linear_dw(x, g),)
    return (k.linear_dw(x, g), k.bias_dw(g))


class AttentionPasses(nn.Cell):
    """Passes of ``ms_models.attention.Attention`` (training form: [B, S, H] inputs)."""

    def __init__(self, attn):
        super().__init__(auto_prefix=False)
        self.attn = attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = attn.scale

    def weights(self) -> list:
        a = self.attn
        return [*_linear_weights(a.q_proj), *_linear_weights(a.k_proj), *_linear_weights(a.v_proj)] + _linear_weights(
            a.o_proj
        )

    def forward(self, h, cos, sin, allowed):
        a = self.attn
        b, s = h.shape[0], h.shape[1]
        q = _linear(h, a.q_proj).reshape(b, s, self.num_heads, self.head_dim)
        k = _linear(h, a.k_proj).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = _linear(h, a.v_proj).reshape(b, s, self.num_kv_heads, self.head_dim)
        o, core = P.attention(P.rope(q, cos, sin), P.rope(k, cos, sin), v, allowed, self.scale)
        return _linear(o, a.o_proj), (h, o, core)

    def backward_input(self, saved, g, cos, sin):
        a = self.attn
        h, o, core = saved
        b, s = h.shape[0], h.shape[1]
        dq, dk, dv = P.attention_dx(P.linear_dx(g, a.o_proj.weight), core, self.scale, self.num_heads)
        dq = P.rope_dx(dq, cos, sin).reshape(b, s, -1)
        dk = P.rope_dx(dk, cos, sin).reshape(b, s, -1)
        dv = dv.reshape(b, s, -1)
        dh = P.linear_dx(dq, a.q_proj.weight) + P.linear_dx(dk, a.k_proj.weight) + P.linear_dx(dv, a.v_proj.weight)
        return dh, (h, o, dq, dk, dv, g)

    def backward_weight(self, pairs, k=P):
        a = self.attn
        h, o, dq, dk, dv, g = pairs
        return (
            _linear_grads(a.q_proj, h, dq, k)
            + _linear_grads(a.k_proj, h, dk, k)
            + _linear_grads(a.v_proj, h, dv, k)
            + _linear_grads(a.o_proj, o, g, k)
        )


class MLPPasses(nn.Cell):
    """Passes of the SwiGLU ``ms_models.layers.MLP``: down(silu(gate(x)) * up(x))."""

    def __init__(self, mlp):
        super().__init__(auto_prefix=False)
        self.mlp = mlp

    def weights(self) -> list:
        m = self.mlp
        return _linear_weights(m.gate_proj) + _linear_weights(m.up_proj) + _linear_weights(m.down_proj)

    def forward(self, h):
        m = self.mlp
        gate, up = _linear(h, m.gate_proj), _linear(h, m.up_proj)
        act = P.swiglu(gate, up)
        return _linear(act, m.down_proj), (h, gate, up, act)

    def backward_input(self, saved, g):
        m = self.mlp
        h, gate, up, act = saved
        dgate, dup = P.swiglu_dx(P.linear_dx(g, m.down_proj.weight), gate, up)
        dh = P.linear_dx(dgate, m.gate_proj.weight) + P.linear_dx(dup, m.up_proj.weight)
        return dh, (h, act, dgate, dup, g)

    def backward_weight(self, pairs, k=P):
        m = self.mlp
        h, act, dgate, dup, g = pairs
        gate_up = _linear_grads(m.gate_proj, h, dgate, k) + _linear_grads(m.up_proj, h, dup, k)
        return gate_up + _linear_grads(m.down_proj, act, g, k)
