"""Interleaved 1F1B (Narayanan et al., 2021, arXiv 2104.04473, Fig. 4 bottom; Megatron-LM).

Each rank holds v model chunks ("virtual stages"), stage c*p + r on rank r, so a microbatch loops
v times through the ranks and the warm-up bubble shrinks by v: idle per rank is
(p-1)(T_F + T_B + T_W)/v for the same model.

Every rank walks the same table of (microbatch, chunk) pairs: a group of microbatches through
chunk 0, then the same group through chunk 1, and so on (Megatron's schedule table with
``microbatch_group_size_per_vp_stage``). Groups hold at least g = p microbatches and are as even
as possible (PyTorch's "rounds"), so m need not be a multiple of p; Megatron's short last group
deadlocks for some m (e.g. p=8, m=10), the validator finds it. Forwards follow the table;
backwards follow it with the chunk order reversed. Rank r runs 2(p-1-r) + (v-1)g forwards
before its first backward, then alternates one forward and one backward, then drains.
"""

from __future__ import annotations

from ..errors import ScheduleError
from ..ir import Action, Kind, Schedule
from ..placement import stage_to_rank
from ._common import check_sizes


def _group_sizes(m: int, g: int) -> list[int]:
    """Split m microbatches into groups of at least g (when m >= g), as evenly as possible,
    larger groups first. A short last group (Megatron's table for m % g != 0) can deadlock:
    the warm-up depth assumes every group fills the pipeline."""
    rounds = max(1, m // g)
    return [m // rounds + (1 if i < m % rounds else 0) for i in range(rounds)]


def _table(m: int, v: int, g: int) -> tuple[list[tuple[int, int]], int]:
    """The (microbatch, chunk) order every rank follows, and the size of the first group."""
    table, start = [], 0
    sizes = _group_sizes(m, g)
    for size in sizes:
        group = range(start, start + size)
        table += [(mb, chunk) for chunk in range(v) for mb in group]
        start += size
    return table, sizes[0]


def interleaved_1f1b(
    num_ranks: int, num_microbatches: int, stages_per_rank: int = 2, group_size: int | None = None
) -> Schedule:
    """``stages_per_rank`` chunks per rank in a loop placement, fused backward (BW)."""
    check_sizes("interleaved", num_ranks, num_microbatches, stages_per_rank)
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    g = p if group_size is None else group_size
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ScheduleError(f"interleaved: stages_per_rank and group_size must be >= 1, got {v}, {g}")
    table, first_group = _table(m, v, g)
    total = len(table)
    ranks = []
    for r in range(p):

        def fwd(k: int, r: int = r) -> Action:
            mb, chunk = table[k]
            return Action(chunk * p + r, Kind.F, mb)

        def bwd(k: int, r: int = r) -> Action:
            mb, chunk = table[k]
            return Action((v - 1 - chunk) * p + r, Kind.BW, mb)

        warmup = min(2 * (p - 1 - r) + (v - 1) * first_group, total)
        acts = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [fwd(warmup + k), bwd(k)]
        acts += [bwd(k) for k in range(total - warmup, total)]
        ranks.append(acts)
    return Schedule("interleaved", p * v, m, stage_to_rank(p, v, "loop"), ranks)
