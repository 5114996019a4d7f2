"""DeepSeekMoE: shared experts plus routed experts with DeepSeek-V3's auxiliary-loss-free gate.

Routing (DeepSeek-V3 report sec. 2.1.2, "noaux_tc" in its config):
1. s = sigmoid(x Wg^T); the selection score is s + e_score_correction_bias (the bias steers
   load balance and is never part of the output weights);
2. experts form n_group groups; a group's score is the sum of its top-2 selection scores, and
   only the best topk_group groups stay eligible;
3. top num_experts_per_tok experts by selection score among the eligible ones;
4. weights = s at those experts, normalised to sum 1 (norm_topk_prob), times routed_scaling_factor.

Routed experts are stored stacked, [E, out, in] (io.py maps them to per-expert checkpoint names).
Two ways to run them: "dense" evaluates every expert for every token and weights the results
(static shapes, so it compiles under mindspore.jit and suits tiny expert counts), "dispatch" runs
each expert only on the tokens routed to it (PyNative; the cost grows with top-k, not with E).
"""

from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore import dtype as mstype

from .errors import ModelError
from .layers import MLP, NEG_INF, init_normal, linear


class TopkRouter(nn.Cell):
    """The gate: `weight` [E, H] and the selection-only `e_score_correction_bias` [E] (not trained)."""

    def __init__(self, config, rng=None):
        super().__init__()
        c = config
        self.num_experts, self.top_k = c.n_routed_experts, c.num_experts_per_tok
        self.n_group, self.topk_group = c.n_group, c.topk_group
        self.norm_topk_prob, self.scaling = c.norm_topk_prob, float(c.routed_scaling_factor)
        weight = init_normal((c.n_routed_experts, c.hidden_size), c.initializer_range, rng)
        self.weight = Parameter(weight, name="weight")
        self.e_score_correction_bias = Parameter(
            Tensor(np.zeros(c.n_routed_experts, np.float32)), name="e_score_correction_bias", requires_grad=False
        )

    def construct(self, x):
        """x [M, H] -> (weights [M, k], expert indices [M, k])."""
        m = x.shape[0]
        scores = ops.sigmoid(linear(x.astype(mstype.float32), self.weight.astype(mstype.float32)))
        choice = scores + self.e_score_correction_bias
        per_group = self.num_experts // self.n_group
        grouped = choice.reshape(m, self.n_group, per_group)
        group_scores = ops.topk(grouped, 2)[0].sum(-1)  # [M, G]
        best_groups = ops.topk(group_scores, self.topk_group)[1]  # [M, topk_group]
        group_ids = ops.arange(0, self.n_group, 1, dtype=best_groups.dtype)
        keep = (best_groups.expand_dims(-1) == group_ids).astype(mstype.float32).sum(1) > 0.5  # [M, G]
        keep = ops.broadcast_to(keep.expand_dims(-1), (m, self.n_group, per_group)).reshape(m, self.num_experts)
        choice = ops.where(keep, choice, ops.full_like(choice, NEG_INF))
        indices = ops.topk(choice, self.top_k)[1]
        weights = ops.gather_elements(scores, 1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return weights * self.scaling, indices


class Experts(nn.Cell):
    """Routed SwiGLU experts, stacked: gate_proj/up_proj [E, I, H], down_proj [E, H, I]."""

    def __init__(self, config, rng=None):
        super().__init__()
        c = config
        e, i, h, std = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size, c.initializer_range
        self.num_experts = e
        self.bmm = ops.BatchMatMul(transpose_b=True)
        self.gate_proj = Parameter(init_normal((e, i, h), std, rng), name="gate_proj")
        self.up_proj = Parameter(init_normal((e, i, h), std, rng), name="up_proj")
        self.down_proj = Parameter(init_normal((e, h, i), std, rng), name="down_proj")

    def dense(self, x, weights, indices):
        """Every expert on every token, combined with the routing weights (jit-friendly)."""
        combine = (
            ops.one_hot(indices, self.num_experts, Tensor(1.0, mstype.float32), Tensor(0.0, mstype.float32))
            * weights.expand_dims(-1)
        ).sum(1)  # [M, E]
        return self.mix(x, combine)

    def mix(self, x, combine):
        """sum_e combine[:, e] * expert_e(x): every expert on every row of x [M, H], combine [M, E]
        (zero where a row does not use the expert; a zero row of x gives zero)."""
        # x is copied once per expert rather than every stack transposed per call: CPU's
        # BatchMatMul(transpose_b=True) does not broadcast a [1, M, H] input, and the copies cost
        # less than three [E, out, in] transposes (decode, 2 tokens: 0.19 vs 0.56 ms a layer; 4096
        # tokens: 42 vs 76 ms, E = 8, H = 256, I = 128)
        xe = ops.broadcast_to(x.expand_dims(0), (self.num_experts,) + x.shape)  # [E, M, H]
        h = ops.silu(self.bmm(xe, self.gate_proj)) * self.bmm(xe, self.up_proj)
        y = self.bmm(h, self.down_proj)  # [E, M, H]
        return (combine.T.expand_dims(-1).astype(y.dtype) * y).sum(0)

    def dispatch(self, x, weights, indices):
        """Each expert on its routed tokens only (PyNative: the token lists are data dependent)."""
        chosen = indices.asnumpy()
        out = ops.zeros_like(x)
        for e in np.unique(chosen):
            rows, slot = np.nonzero(chosen == e)
            rows_t = Tensor(rows.astype(np.int32))
            xe = x[rows_t]
            h = ops.silu(linear(xe, self.gate_proj[int(e)])) * linear(xe, self.up_proj[int(e)])
            y = linear(h, self.down_proj[int(e)]) * weights[rows_t, Tensor(slot.astype(np.int32))].expand_dims(-1)
            out = ops.tensor_scatter_add(out, rows_t.expand_dims(-1), y.astype(out.dtype))
        return out


class MoE(nn.Cell):
    """DeepSeekMoE layer (HF names: gate, experts, shared_experts)."""

    IMPLS = ("dense", "dispatch")

    def __init__(self, config, rng=None, impl: str = "dense"):
        super().__init__()
        c = config
        self.gate = TopkRouter(c, rng)
        self.experts = Experts(c, rng)
        self.shared_experts = (
            MLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, False, c.initializer_range, rng)
            if c.n_shared_experts
            else None
        )
        self.impl = "dense"
        self.set_impl(impl)

    def set_impl(self, impl: str) -> None:
        """Choose how routed experts run: "dense" (jit-friendly) or "dispatch" (PyNative, sparse)."""
        if impl not in self.IMPLS:
            raise ModelError(f"MoE impl {impl!r}; expected one of {self.IMPLS}")
        self.impl = impl

    def construct(self, x):
        """x [..., H] -> [..., H]."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat)
        if self.impl == "dispatch":
            routed = self.experts.dispatch(flat, weights, indices)
        else:
            routed = self.experts.dense(flat, weights, indices)
        out = routed.reshape(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
