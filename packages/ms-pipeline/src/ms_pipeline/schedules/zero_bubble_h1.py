"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv 2401.10241, Fig. 3 top).

The backward is split into B (input gradient, on the critical path between stages) and W (weight
gradient, needed by no other stage). The order is 1F1B's with B in place of the fused backward;
W is postponed so that it fills the cool-down bubbles instead of delaying the next B. Rank r holds
back its first r weight passes, so every rank keeps at most p microbatches alive (p-1-r warm-up
forwards + r pending W + 1), the same peak as 1F1B's rank 0:

    rank 0: F0 F1 F2 F3 B0 W0 F4 B1 W1 ...              warm-up 3, W right after B
    rank 3:          F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 ...  warm-up 0, W held back 3 steps

Idle time per rank is (p-1)(T_F + T_B - T_W): bubble rate (p-1)/(3m+p-1) at equal costs, a third
of 1F1B's. This is PyTorch's ``ScheduleInterleavedZeroBubble`` with one stage per rank (ZB1P).
"""

from __future__ import annotations

from collections import deque

from ..ir import Action, Kind, Schedule
from ..placement import stage_to_rank
from ._common import check_sizes


def zero_bubble_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """One stage per rank, B and W split, memory no higher than 1F1B."""
    check_sizes("zbh1", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    ranks = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        acts = [Action(r, Kind.F, i) for i in range(warmup)]
        pending_w: deque[int] = deque()

        def backward(i: int, acts: list = acts, pending_w: deque = pending_w, r: int = r) -> None:
            acts.append(Action(r, Kind.B, i))
            pending_w.append(i)
            if i >= r:  # the first r weight passes wait; later ones follow their B
                acts.append(Action(r, Kind.W, pending_w.popleft()))

        for i in range(m - warmup):  # steady phase: F of a new microbatch, B of the oldest
            acts.append(Action(r, Kind.F, warmup + i))
            backward(i)
        for i in range(m - warmup, m):  # cool-down
            backward(i)
        acts += [Action(r, Kind.W, i) for i in pending_w]  # the held-back W fill the tail
        ranks.append(acts)
    return Schedule("zbh1", p, m, stage_to_rank(p), ranks)
