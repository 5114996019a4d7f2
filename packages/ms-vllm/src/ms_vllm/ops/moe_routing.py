"""MoE init-routing and combine as MindSpore functions (CANN's MoeInitRouting / MoeInitRoutingQuant).

init-routing takes tokens x [N, H] and each token's top-k experts [N, K] and lays the N * K
(token, expert) pairs out sorted by expert, so each expert's rows are contiguous for a grouped
matmul:

    flat e = expert_idx.flatten()                      (pair i = token i // K, slot i % K)
    order = stable sort of e                           (CANN: key-value sort of expert ids)
    expanded_x[j]        = x[order[j] // K]            (optionally quantized to int8 here)
    expanded_row_idx[i]  = position of pair i in the sorted order   (CANN's expandedRowIdx)
    expert_tokens[e]     = rows of expert e            (cumulative counts: the group list)

combine undoes it: out[n] = sum_k w[n, k] * y[expanded_row_idx[n * K + k]].

The quantized variant (MoeInitRoutingQuant, as used before W8A8 expert matmuls) applies
`round(x * scale + offset)` clipped to int8 in the same pass. On Ascend the fused kernels run; on
CPU (where MindSpore 2.10 reports "The kernel MoeInitRoutingV2 unregistered") the same results
come from sort + gather with ops that have CPU kernels. Tests check both paths' definitions
against a numpy reference.
"""

from __future__ import annotations

from dataclasses import dataclass

from mindspore import Tensor, ops
from mindspore import dtype as mstype

from . import ascend_available


@dataclass
class Routed:
    """The result of moe_init_routing."""

    expanded_x: Tensor
    """[N * K, H] token rows sorted by expert (int8 when quantized)."""
    expanded_row_idx: Tensor
    """[N * K] int32: for pair i = (token i // K, slot i % K), its row in expanded_x."""
    sorted_expert_idx: Tensor
    """[N * K] int32: the expert of each row of expanded_x (non-decreasing)."""
    expert_tokens: Tensor
    """[E] int32: cumulative row counts per expert (the grouped matmul's group list)."""


def _quantize(x: Tensor, scale: float, offset: float) -> Tensor:
    y = ops.round(x.astype(mstype.float32) * scale + offset)
    return ops.clip_by_value(y, Tensor(-128.0, mstype.float32), Tensor(127.0, mstype.float32)).astype(mstype.int8)


def _init_routing_cpu(x: Tensor, expert_idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n, k = expert_idx.shape
    flat = expert_idx.reshape(-1).astype(mstype.int32)
    # A stable sort: key = expert * (N * K) + pair index is unique, so the order is deterministic
    # and ties keep the pair order, as CANN's stable key-value sort does.
    pair = ops.arange(0, n * k, 1, dtype=mstype.int32)
    keys = (flat * (n * k) + pair).astype(mstype.float32 if n * k * num_experts < (1 << 24) else mstype.float64)
    _, order = ops.sort(keys)
    order = order.astype(mstype.int32)
    expanded_x = ops.gather(x, order // k, 0)
    expanded_row_idx = ops.zeros((n * k,), mstype.int32)
    expanded_row_idx = ops.tensor_scatter_update(expanded_row_idx, order.reshape(-1, 1), pair)
    sorted_experts = ops.gather(flat, order, 0)
    counts = ops.bincount(flat, minlength=num_experts)[:num_experts].astype(mstype.int32)
    return expanded_x, expanded_row_idx, sorted_experts, ops.cumsum(counts, 0).astype(mstype.int32)


def moe_init_routing(
    x: Tensor,
    expert_idx: Tensor,
    num_experts: int,
    quant_scale: float | None = None,
    quant_offset: float = 0.0,
) -> Routed:
    """Sort (token, expert) pairs by expert and expand x; quantize to int8 in the same pass when
    `quant_scale` is given (MoeInitRoutingQuant)."""
    if ascend_available():  # pragma: no cover - needs an NPU; not exercised on this CPU-only CI
        n, k = expert_idx.shape
        # CANN numbers pair (token n, slot k) as k * N + n and reads x[row % N]; convert to ours.
        cann_rows = ops.arange(0, n * k, 1, dtype=mstype.int32).reshape(k, n).T
        expanded_x, row_idx, experts = ops.moe_init_routing(x, cann_rows, expert_idx.astype(mstype.int32), n)
        row_idx = row_idx.reshape(k, n).T.reshape(-1)
        counts = ops.bincount(expert_idx.reshape(-1), minlength=num_experts)[:num_experts]
        tokens = ops.cumsum(counts, 0).astype(mstype.int32)
    else:
        expanded_x, row_idx, experts, tokens = _init_routing_cpu(x, expert_idx, num_experts)
    if quant_scale is not None:
        expanded_x = _quantize(expanded_x, quant_scale, quant_offset)
    return Routed(expanded_x, row_idx, experts, tokens)


def moe_combine(expert_out: Tensor, routed: Routed, weights: Tensor) -> Tensor:
    """out [N, H] = sum_k weights[n, k] * expert_out[expanded_row_idx[n * K + k]] (MoeFinalizeRouting)."""
    n, k = weights.shape
    rows = ops.gather(expert_out, routed.expanded_row_idx, 0).reshape(n, k, -1)
    return (rows * weights.astype(rows.dtype).expand_dims(-1)).sum(1)


def grouped_swiglu(expanded_x: Tensor, expert_tokens: Tensor, gate, up, down) -> Tensor:
    """Each expert's SwiGLU on its contiguous rows (gate/up [E, I, H], down [E, H, I]); the CPU
    stand-in for GroupedMatmul, one matmul per expert that has rows."""
    bounds = [0, *[int(v) for v in expert_tokens.asnumpy()]]
    pieces = []
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        if hi == lo:
            continue
        xe = expanded_x[lo:hi]
        h = ops.silu(ops.matmul(xe, gate[e].T)) * ops.matmul(xe, up[e].T)
        pieces.append(ops.matmul(h, down[e].T))
    return ops.cat(pieces, 0)
