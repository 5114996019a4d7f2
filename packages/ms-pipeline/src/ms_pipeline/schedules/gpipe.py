"""GPipe (Huang et al., 2019, arXiv 1811.06965, Fig. 2c): every forward, then every backward.

    rank 0: F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
    rank 1:    F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3
    ...
All m microbatches' activations are alive at once on every rank, which is what 1F1B fixes.
"""

from __future__ import annotations

from ..ir import Action, Kind, Schedule
from ..placement import stage_to_rank
from ._common import check_sizes


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """One stage per rank; all forwards, then all fused backwards (BW) in microbatch order."""
    check_sizes("gpipe", num_ranks, num_microbatches)
    m = num_microbatches
    ranks = []
    for r in range(num_ranks):
        ranks.append([Action(r, Kind.F, i) for i in range(m)] + [Action(r, Kind.BW, i) for i in range(m)])
    return Schedule("gpipe", num_ranks, m, stage_to_rank(num_ranks), ranks)
