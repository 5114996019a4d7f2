"""ZeroBubbleV (Qi et al., arXiv 2401.10241 Section 6, Fig. 8; the V shape of sail-sg's ZB-V).

Every rank holds two chunks in a V: rank i holds stage i (chunk 0, going down) and stage 2p-1-i
(chunk 1, coming back up), so the last stage, and the loss, sit on rank 0 next to the first. The
backward is split into B (dx) and W (dw). The phases, for rank i of p (PyTorch's
``ScheduleZBVZeroBubble`` follows the same pattern):

  1. warm-up:  2(p-i)-1 forwards of chunk 0;
  2.           i pairs (F chunk 1, F chunk 0): the first chunk-1 inputs come back up the V;
  3.           p-i triples (F, B, W) of chunk 1: the first backwards start at the turn;
  4. steady:   (F0 B0 W0 F1 B1 W1) while forwards remain;
  5. cool-down: i pairs (B0, B1), then p-i pairs (B0, W0): B stays on the critical path;
  6. drain:    the remaining W1, then W0, filling what would otherwise be the tail bubble.

At most 2p chunk-microbatches are alive on a rank, that is p microbatches of a whole rank's
layers: the same activation memory as 1F1B. With T_F = T_B = T_W a rank never waits between its
first and its last action (rank i starts i chunk forwards late and ends p-1-i early), which is why
the authors, who count idle time only within that span, call the schedule zero-bubble.

With fewer than 2p-1 microbatches the pattern is built for 2p-1 and the missing microbatches are
dropped (as PyTorch does). ``overlap=True`` fuses the steady phase into 1B1F pairs: each B is run
together with the next F (of the other chunk), and its W follows the pair -- the F0B1/F1B0 main
step of DualPipeV and MindSpore's ``pp_1f1b_overlap``.
"""

from __future__ import annotations

from ..ir import Action, Kind, Schedule, check_schedule_size
from ..placement import stage_to_rank
from ._common import check_sizes


class _Rank:
    """Appends one rank's actions, counting microbatches per (chunk, kind)."""

    def __init__(self, stages: tuple[int, int], overlap: bool):
        self.stages = stages
        self.count = {(c, k): 0 for c in (0, 1) for k in (Kind.F, Kind.B, Kind.W)}
        self.acts: list[Action] = []
        self.overlap = overlap
        self.held: list[Action] = []  # a B (and its W) waiting for the next F to pair with

    def _next(self, chunk: int, kind: Kind) -> Action:
        i = self.count[chunk, kind]
        self.count[chunk, kind] = i + 1
        return Action(self.stages[chunk], kind, i)

    def f(self, chunk: int) -> None:
        action = self._next(chunk, Kind.F)
        if self.held:
            self.acts.append(Action.overlap(action, self.held[0]))
            self.acts.extend(self.held[1:])
            self.held = []
        else:
            self.acts.append(action)

    def b(self, chunk: int, with_w: bool = False) -> None:
        actions = [self._next(chunk, Kind.B)]
        if with_w:
            actions.append(self._next(chunk, Kind.W))
        if self.overlap:
            self.flush()
            self.held = actions
        else:
            self.acts.extend(actions)

    def w(self, chunk: int) -> None:
        self.acts.append(self._next(chunk, Kind.W))

    def flush(self) -> None:
        self.acts.extend(self.held)
        self.held = []


def _rank_actions(p: int, i: int, n: int, overlap: bool) -> list[Action]:
    rank = _Rank((i, 2 * p - 1 - i), overlap=False)
    for _ in range(2 * (p - i) - 1):  # 1. warm-up, chunk 0
        rank.f(0)
    for _ in range(i):  # 2. chunk-1 inputs start coming back up
        rank.f(1)
        rank.f(0)
    for _ in range(p - i):  # 3. first backwards at the turn of the V
        rank.f(1)
        rank.b(1, with_w=True)
    rank.overlap = overlap
    while rank.count[1, Kind.F] < rank.count[0, Kind.F] or rank.count[0, Kind.F] < n:  # 4. steady
        if rank.count[0, Kind.F] < n:
            rank.f(0)
        rank.b(0, with_w=True)
        rank.f(1)
        rank.b(1, with_w=True)
    rank.flush()
    rank.overlap = False
    for _ in range(i):  # 5. cool-down: B first, it is on the critical path
        rank.b(0)
        rank.b(1)
    for _ in range(p - i):
        rank.b(0)
        rank.w(0)
    for chunk in (1, 0):  # 6. drain the held-back weight passes
        while rank.count[chunk, Kind.W] < rank.count[chunk, Kind.B]:
            rank.w(chunk)
    return rank.acts


def _drop_missing(acts: list[Action], m: int) -> list[Action]:
    """Remove the microbatches >= m the pattern was padded with; a pair keeps its real half."""
    out = []
    for a in acts:
        if a.parts is None:
            if a.microbatch < m:
                out.append(a)
            continue
        real = [h for h in a.parts if h.microbatch < m]
        if len(real) == 2:
            out.append(a)
        else:
            out.extend(real)
    return out


def zero_bubble_v(num_ranks: int, num_microbatches: int, overlap: bool = False) -> Schedule:
    """2 * num_ranks stages in a V placement, B and W split; ``overlap`` for 1B1F steady pairs."""
    check_sizes("zbv", num_ranks, num_microbatches, 2)
    p, m = num_ranks, num_microbatches
    n = max(2 * p - 1, m)
    if n > m:  # the pattern is built for n microbatches, then cut: the work is 2p x n
        check_schedule_size(2 * p, n, f"zbv ({p} ranks x 2, the V pattern padded to {n} microbatches)")
    ranks = [_drop_missing(_rank_actions(p, i, n, overlap), m) for i in range(p)]
    return Schedule("zbv", 2 * p, m, stage_to_rank(p, 2, "v"), ranks)
