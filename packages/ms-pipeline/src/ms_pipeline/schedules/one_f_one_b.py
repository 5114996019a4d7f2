"""1F1B, the PipeDream-Flush schedule (Narayanan et al., 2021, arXiv 2104.04473, Fig. 4 top).

Rank r first runs p-1-r forwards (warm-up), then alternates one forward and one full backward
(steady phase), then drains the remaining backwards (cool-down):

    rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 ...      warm-up p-1 = 3
    rank 3:          F0 B0 F1 B1 F2 B2 ...      warm-up 0

At most p-r microbatches are alive on rank r, so the peak (rank 0) is p, not m as in GPipe.
Idle time per rank is (p-1)(T_F + T_B + T_W): bubble rate (p-1)/(m+p-1) at equal costs.
"""

from __future__ import annotations

from ..ir import Action, Kind, Schedule
from ..placement import stage_to_rank
from ._common import check_sizes


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """One stage per rank, fused backward (BW)."""
    check_sizes("1f1b", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    ranks = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        acts = [Action(r, Kind.F, i) for i in range(warmup)]
        for i in range(m - warmup):  # steady: the forward of a new microbatch, the backward of the oldest
            acts += [Action(r, Kind.F, warmup + i), Action(r, Kind.BW, i)]
        acts += [Action(r, Kind.BW, i) for i in range(m - warmup, m)]  # cool-down
        ranks.append(acts)
    return Schedule("1f1b", p, m, stage_to_rank(p), ranks)
