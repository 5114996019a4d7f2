"""The cells of a tensor/expert-parallel shard that communicate, over an `ms_layout.comm` group.

    column-parallel q/k/v, gate/up    plain Linear of the local width: no communication
    RowParallelLinear                 o_proj, down_proj: all-reduce of the partial sums, then the bias once
    RowParallelWrapper                the same around another cell's partial (quantized, LoRA)
    ParallelMoE                       router replicated; routed (EP: own experts; TP: own columns)
                                      plus shared-expert partials, one all-reduce per layer
    VocabParallelEmbedding            rows outside the rank's vocabulary slice are zero; all-reduce
    CopyToTP                          Megatron's f (training): identity forward, all-reduce of the gradient
    reduce_from_tp                    Megatron's g (training): all-reduce forward, gradient passed through
    DispatchMoE                       DP attention + EP: router and shared experts whole on every rank;
                                      the rank's tokens go to their experts' ranks and back by
                                      all-to-all (dispatch.py), no all-reduce

The collectives run on the host (numpy arrays through the group: gloo on CPU). In `defer` mode
(`defer_collectives`) a cell returns its partial sum instead, so a caller that compiles the
stretches between collectives, or overlaps them with other work, runs the collective itself.
"""

from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from ..layers import linear
from .plan import ShardPlan


def all_reduce(x: Tensor, group) -> Tensor:
    """Sum of x over the group (a copy: the result never aliases MindSpore's buffer)."""
    arr = np.array(x.asnumpy(), copy=True, order="C")
    group.all_reduce(arr)
    return Tensor.from_numpy(arr)


def reduce_from_tp(x: Tensor, group) -> Tensor:
    """Megatron's g: the sum of x over the group in the forward; in the backward each rank's partial
    gets the sum's gradient unchanged. The sum enters as a constant plus (x - x), exactly zero, so
    the value is the sum bit for bit and the tape keeps no second tensor."""
    return ops.stop_gradient(all_reduce(x, group)) + (x - ops.stop_gradient(x))


class CopyToTP(nn.Cell):
    """Megatron's f: identity in the forward; the gradient is all-reduced over the TP group."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        return (all_reduce(dout, self.group),)


class RowParallelLinear(nn.Cell):
    """y = all_reduce(x_local W_local^T) + b: W split along its input dim, b added once after the sum."""

    defer = False
    """True: return the partial sum x_local W_local^T (the caller all-reduces and adds the bias)."""
    grad_through = False
    """True: the all-reduce is Megatron's g (reduce_from_tp), so the layer trains in PyNative."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group):
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.weight = Parameter(Tensor(np.zeros((out_features, in_features), np.float32)), name="weight")
        self.bias = Parameter(Tensor(np.zeros(out_features, np.float32)), name="bias") if bias else None

    @classmethod
    def like(cls, linear_cell, group) -> RowParallelLinear:
        """The row-parallel twin of an ms-models Linear already sized for one rank."""
        return cls(linear_cell.in_features, linear_cell.out_features, linear_cell.bias is not None, group)

    def construct(self, x):
        y = linear(x, self.weight)
        if self.defer:
            return y
        y = reduce_from_tp(y, self.group) if self.grad_through else all_reduce(y, self.group)
        return y if self.bias is None else y + self.bias


class RowParallelWrapper(RowParallelLinear):
    """A row-parallel layer whose local product is another cell of the rank's input columns (a
    quantized linear, or a float one plus LoRA's partial): all-reduce of the partial sums (the
    caller's in defer mode), then the bias once. `inner` must not add a bias itself."""

    def __init__(self, inner, bias, group, in_features: int, out_features: int):
        super(RowParallelLinear, self).__init__()  # (no float weight of its own)
        self.inner, self.group = inner, group
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else Tensor(np.asarray(bias, np.float32))

    def construct(self, x):
        y = self.inner(x)
        if self.defer:
            return y
        y = all_reduce(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Cell):
    """Rows [rank * V/tp, (rank + 1) * V/tp) of the table; other ids read zeros, the all-reduce fills them."""

    defer = False
    """True: return this rank's rows only (the caller all-reduces)."""

    def __init__(self, rows: int, hidden: int, rank: int, group):
        super().__init__()
        self.rows, self.start, self.group = rows, rank * rows, group
        self.weight = Parameter(Tensor(np.zeros((rows, hidden), np.float32)), name="weight")

    def construct(self, ids):
        local = ids - self.start
        mine = ops.logical_and(local >= 0, local < self.rows)
        x = ops.gather(self.weight, ops.where(mine, local, ops.zeros_like(local)), 0)
        x = x * mine.expand_dims(-1).astype(x.dtype)
        return x if self.defer else all_reduce(x, self.group)


class ParallelMoE(nn.Cell):
    """DeepSeekMoE over the ranks: the full router on every rank, this rank's routed experts (EP) or
    expert columns (TP) and its shared-expert columns, one all-reduce of the summed partials.

    Keeps the attribute names of ms-models' MoE (gate, experts, shared_experts), so the parameter
    names, and with them the checkpoint names, stay the same."""

    defer = False
    """True: return the partial sum (the caller all-reduces)."""

    def __init__(self, moe, full_config, plan: ShardPlan, group):
        super().__init__()
        c, tp = full_config, plan.tp
        self.group, self.impl, self.ep = group, moe.impl, plan.expert_parallel
        self.experts = moe.experts
        if self.ep:
            # The local config gave the router only this rank's experts; routing needs all of them.
            self.gate = type(moe.gate)(c)
            shared = None
            if moe.shared_experts is not None:
                width = c.moe_intermediate_size * c.n_shared_experts // tp
                shared = type(moe.shared_experts)(c.hidden_size, width, False, c.initializer_range)
            self.shared_experts = shared
        else:
            self.gate, self.shared_experts = moe.gate, moe.shared_experts
        self.first, _ = plan.expert_range(c.n_routed_experts)
        self.n_local = moe.experts.num_experts

    def construct(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat)  # global expert ids
        if self.ep:
            # Another rank's expert gets weight 0 here (and index 0, any valid one): its rank adds it.
            local = indices - self.first
            mine = ops.logical_and(local >= 0, local < self.n_local)
            weights = ops.where(mine, weights, ops.zeros_like(weights))
            indices = ops.where(mine, local, ops.zeros_like(local))
        if self.impl == "dispatch":
            routed = self.experts.dispatch(flat, weights, indices)
        else:
            routed = self.experts.dense(flat, weights, indices)
        out = routed.reshape(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if self.defer else all_reduce(out, self.group)


class DispatchMoE(nn.Cell):
    """DeepSeekMoE under DP attention and EP: every rank routes its own tokens with the full router,
    runs its shared experts whole, and exchanges the routed part by all-to-all (dispatch.exchange).

    Keeps MoE's attribute names (gate, experts, shared_experts): same parameter names. Every rank of
    the group must run each layer once per step (a rank without tokens runs it on zero rows)."""

    def __init__(self, moe, full_config, plan: ShardPlan, group):
        super().__init__()
        c = full_config
        self.group = group
        self.gate = type(moe.gate)(c)  # the local config's router knows only this rank's experts
        self.experts, self.shared_experts = moe.experts, moe.shared_experts
        self.per_rank = c.n_routed_experts // plan.ep
        self.last_stats: dict = {}
        """The last exchange's capacity and row counts (dispatch.exchange)."""

    def routed(self, flat, weights, indices, experts=None):
        """The routed-expert output [M, H] of flat [M, H] (host exchange); `experts(x, mix)` numpy ->
        numpy, by default this cell's experts in PyNative."""
        from .dispatch import exchange, route

        if experts is None:
            experts = lambda x, mix: self.experts.mix(Tensor(x), Tensor(mix)).asnumpy()  # noqa: E731
        plan = route(indices.asnumpy(), weights.asnumpy(), self.group.size, self.per_rank)
        out, self.last_stats = exchange(self.group, flat.asnumpy(), plan, experts)
        return Tensor.from_numpy(out)

    def construct(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat)
        out = self.routed(flat, weights, indices).reshape(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def defer_collectives(model) -> None:
    """Switch every communicating cell of a sharded model to return its partial sum (the caller then
    runs the collectives); the model's own forward no longer communicates after this."""
    for _, cell in model.cells_and_names():
        if isinstance(cell, (RowParallelLinear, VocabParallelEmbedding, ParallelMoE)):
            cell.defer = True


__all__ = [
    "CopyToTP",
    "DispatchMoE",
    "ParallelMoE",
    "RowParallelLinear",
    "RowParallelWrapper",
    "VocabParallelEmbedding",
    "all_reduce",
    "defer_collectives",
    "reduce_from_tp",
]
