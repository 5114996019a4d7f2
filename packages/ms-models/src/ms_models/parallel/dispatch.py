"""Expert-parallel token exchange: dispatch tokens to the ranks that hold their experts, combine back.

Each rank routes its own tokens (its own requests under DP attention), then per MoE layer:

    route      for every destination rank d: the rows of this rank's tokens that chose one of d's
               experts (each row once, however many of d's experts it chose, as DeepSeek-V3 sends a
               token once per node) and a `mix` row of its weights for d's local experts
    counts     all-gather of every rank's row counts -> the [src, dst] table, and `cap`, its
               maximum rounded up to a power of two (padding to a few shapes keeps the expert
               computation compiled)
    dispatch   all-to-all of [ranks, cap, H + E_local] (token rows and their mix rows)
    experts    every local expert on every received row, weighted by the mix (zero rows stay zero)
    combine    all-to-all of the [ranks, cap, H] results back to the token's rank, summed per row

Volume per layer is the routed tokens (padded to cap), not the whole batch of every rank as an
all-gather (or an all-reduce of full outputs) moves. numpy only: the exchange runs on the host
over an `ms_layout.comm` group; the expert computation is the caller's (a compiled graph).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass
class Routed:
    """Where this rank's tokens go: per destination rank, which rows and with what expert weights."""

    rows: list[np.ndarray]
    """Per destination rank: the token rows sent there (ascending, each once)."""
    mix: list[np.ndarray]
    """Per destination rank: [len(rows), experts_per_rank] routing weights for its local experts."""


def route(indices: np.ndarray, weights: np.ndarray, ranks: int, per_rank: int) -> Routed:
    """Group the (token, expert) choices [M, k] by the rank owning the expert (expert e on rank e // per_rank)."""
    indices = np.asarray(indices, np.int64)
    weights = np.asarray(weights, np.float32)
    if indices.shape != weights.shape or indices.ndim != 2:
        raise ValueError(f"indices {indices.shape} and weights {weights.shape}: expected equal [tokens, k] shapes")
    if indices.size and (indices.min() < 0 or indices.max() >= ranks * per_rank):
        raise ValueError(f"expert index {int(indices.max())} outside 0..{ranks * per_rank - 1}")
    owner, local = indices // per_rank, indices % per_rank
    rows, mixes = [], []
    for d in range(ranks):
        hit = owner == d
        r = np.flatnonzero(hit.any(1))
        mix = np.zeros((len(r), per_rank), np.float32)
        t, s = np.nonzero(hit[r])
        np.add.at(mix, (t, local[r][t, s]), weights[r][t, s])
        rows.append(r)
        mixes.append(mix)
    return Routed(rows, mixes)


def capacity(count: int) -> int:
    """Rows per (source, destination) pair: the largest count rounded up to a power of two (>= 1)."""
    return 1 << max(int(count) - 1, 0).bit_length()


def exchange(
    group, x: np.ndarray, routed: Routed, experts: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> tuple[np.ndarray, dict]:
    """The routed-expert output [M, H] of this rank's tokens x [M, H]: dispatch, `experts(rows
    [ranks * cap, H], mix [ranks * cap, E_local]) -> [ranks * cap, H]` on what arrived, combine.
    Every rank of `group` must call it (a rank without tokens too: M = 0). Also returns stats."""
    n, me = group.size, group.rank
    m, h = x.shape
    per = routed.mix[0].shape[1]
    counts = np.array([len(r) for r in routed.rows], np.int64)
    table = group.all_gather(counts).reshape(n, n)  # table[src, dst]
    cap = capacity(int(table.max()))
    send = np.zeros((n, cap, h + per), np.float32)
    for d, (rows, mix) in enumerate(zip(routed.rows, routed.mix)):
        send[d, : len(rows), :h] = x[rows]
        send[d, : len(rows), h:] = mix
    recv = group.all_to_all(send.reshape(n * cap, h + per)).reshape(n, cap, h + per)
    rows_in = np.ascontiguousarray(recv[..., :h]).reshape(n * cap, h)
    y = experts(rows_in, np.ascontiguousarray(recv[..., h:]).reshape(n * cap, per))
    back = group.all_to_all(np.ascontiguousarray(y, np.float32).reshape(n * cap, h)).reshape(n, cap, h)
    out = np.zeros((m, h), np.float32)
    for d, rows in enumerate(routed.rows):
        out[rows] += back[d, : len(rows)]
    stats = {"cap": cap, "sent_rows": int(counts.sum()), "received_rows": int(table[:, me].sum())}
    return out, stats


__all__ = ["Routed", "capacity", "exchange", "route"]
