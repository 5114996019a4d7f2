"""Explicit passes of DeepSeekMoE (``ms_models.moe.MoE``, the "dense" impl).

Forward, over the flat tokens x [M, H] (E experts of width I, top-k routing)::

    s        = sigmoid(x Wg^T)                                       [M, E]
    idx      = group-limited top-k of s + e_score_correction_bias    (no gradient: a selection)
    w        = s[idx] (/ sum), times routed_scaling_factor           [M, k]
    c        = scatter of w into the E columns                       [M, E]
    gate, up = x Wgate^T, x Wup^T, all experts in one GEMM each      [M, E * I]
    a        = silu(gate) * up;   a_c = c * a (per expert column block)
    y        = sum_e a_c[e] Wdown[e]^T  (+ shared experts' MLP)      [M, H]

Weighting the activation before down_proj instead of its output gives the same sum (linear in
each expert) and keeps the saved values [M, E * I] instead of [E, M, H]. The expert stacks are read
as stored: gate/up as 2-D [E * I, H] reshapes, down through ``BatchMatMul(transpose_b)`` with equal
batch dims. Saved: x, the scores, the indices and raw weights (for the normalisation's backward),
c, gate, up, a and a_c. down_proj's backward broadcasts g to [E, M, H] (CPU's BatchMatMul does not
broadcast batch dims), which that weight's W pass reuses. The router's weight gets its gradient
through the gathered scores: dc -> dw -> ds (through the normalisation) -> d(logits) = ds s (1 - s).
"""

from __future__ import annotations

from mindspore import Tensor, nn, ops
from mindspore import dtype as mstype

from ..layers import NEG_INF, linear, stacked_linear
from . import ops as P
from .dense import MLPPasses

_ONE, _ZERO = Tensor(1.0, mstype.float32), Tensor(0.0, mstype.float32)
_BMM = ops.BatchMatMul()


def _scatter(values, indices, num: int):
    """[M, k] values placed at columns `indices` [M, k] of a zero [M, num] (indices distinct per row)."""
    return (ops.one_hot(indices, num, _ONE, _ZERO) * values.expand_dims(-1)).sum(1)


class MoEPasses(nn.Cell):
    """Passes of ``MoE`` with impl "dense": forward(h), backward_input(saved, g), backward_weight(pairs).
    weights(): router weight, gate/up/down expert stacks, then the shared experts' (if any); the
    router's e_score_correction_bias is not trained and not listed."""

    def __init__(self, moe):
        super().__init__(auto_prefix=False)
        r, ex = moe.gate, moe.experts
        self.router, self.experts = r, ex
        self.num_experts, self.top_k = r.num_experts, r.top_k
        self.n_group, self.topk_group = r.n_group, r.topk_group
        self.norm_topk_prob, self.scaling = r.norm_topk_prob, r.scaling
        self.inter = ex.gate_proj.shape[1]
        self.shared = MLPPasses(moe.shared_experts) if moe.shared_experts is not None else None

    def weights(self) -> list:
        ex = self.experts
        out = [self.router.weight, ex.gate_proj, ex.up_proj, ex.down_proj]
        return out + (self.shared.weights() if self.shared is not None else [])

    def _select(self, scores):
        """TopkRouter's group-limited top-k of the selection scores -> expert indices [M, k]."""
        m, e, groups = scores.shape[0], self.num_experts, self.n_group
        choice = scores + self.router.e_score_correction_bias
        grouped = choice.reshape(m, groups, e // groups)
        best = ops.topk(ops.topk(grouped, 2)[0].sum(-1), self.topk_group)[1]  # [M, topk_group]
        keep = (best.expand_dims(-1) == ops.arange(0, groups, 1, dtype=best.dtype)).astype(mstype.float32).sum(1)
        keep = ops.broadcast_to((keep > 0.5).expand_dims(-1), (m, groups, e // groups)).reshape(m, e)
        choice = ops.where(keep, choice, ops.full_like(choice, NEG_INF))
        return ops.stop_gradient(ops.topk(choice, self.top_k)[1])

    def forward(self, h):
        ex = self.experts
        e, i = self.num_experts, self.inter
        x = h.reshape(-1, h.shape[-1])
        m = x.shape[0]
        scores = ops.sigmoid(linear(x, self.router.weight))
        indices = self._select(scores)
        raw = ops.gather_elements(scores, 1, indices)  # [M, k]
        w = raw / (raw.sum(-1, keepdims=True) + 1e-20) if self.norm_topk_prob else raw
        combine = _scatter(w * self.scaling, indices, e)  # [M, E]
        gate = linear(x, ex.gate_proj.reshape(e * i, -1))
        up = linear(x, ex.up_proj.reshape(e * i, -1))
        act = P.swiglu(gate, up)
        act_c = (act.reshape(m, e, i) * combine.expand_dims(-1)).transpose(1, 0, 2)  # [E, M, I]
        y = stacked_linear(act_c, ex.down_proj).sum(0).reshape(h.shape)
        saved = (x, scores, indices, raw, combine, gate, up, act, act_c)
        if self.shared is None:
            return y, (saved, ())
        ys, s_shared = self.shared.forward(h)
        return y + ys, (saved, s_shared)

    def backward_input(self, saved, g):
        ex = self.experts
        e, i = self.num_experts, self.inter
        (x, scores, indices, raw, combine, gate, up, act, act_c), s_shared = saved
        m = x.shape[0]
        gf = g.reshape(m, -1)
        g_e = ops.broadcast_to(gf.expand_dims(0), (e, m, gf.shape[-1]))  # CPU BatchMatMul: equal batch dims
        dact_c = _BMM(g_e, ex.down_proj).transpose(1, 0, 2)  # [M, E, I]
        dcombine = (dact_c * act.reshape(m, e, i)).sum(-1)  # [M, E]
        dgate, dup = P.swiglu_dx((dact_c * combine.expand_dims(-1)).reshape(m, e * i), gate, up)
        dx = P.linear_dx(dgate, ex.gate_proj.reshape(e * i, -1)) + P.linear_dx(dup, ex.up_proj.reshape(e * i, -1))
        # router: c = scatter(scaling * w), w = raw / sum(raw) (norm_topk_prob), raw = s[idx]
        dw = ops.gather_elements(dcombine, 1, indices) * self.scaling
        if self.norm_topk_prob:
            total = raw.sum(-1, keepdims=True) + 1e-20
            draw = (dw - (dw * raw).sum(-1, keepdims=True) / total) / total
        else:
            draw = dw
        dlogits = _scatter(draw, indices, e) * scores * (1.0 - scores)
        dx = (dx + P.linear_dx(dlogits, self.router.weight)).reshape(g.shape)
        pairs = (x, dlogits, dgate, dup, act_c, g_e)
        if self.shared is None:
            return dx, (pairs, ())
        dxs, w_shared = self.shared.backward_input(s_shared, g)
        return dx + dxs, (pairs, w_shared)

    def backward_weight(self, pairs, k=P):
        ex = self.experts
        (x, dlogits, dgate, dup, act_c, g_e), w_shared = pairs
        grads = (
            k.linear_dw(x, dlogits),
            k.linear_dw(x, dgate).reshape(ex.gate_proj.shape),
            k.linear_dw(x, dup).reshape(ex.up_proj.shape),
            k.stacked_linear_dw(act_c, g_e),
        )
        return grads if self.shared is None else grads + self.shared.backward_weight(w_shared, k)


__all__ = ["MoEPasses"]
