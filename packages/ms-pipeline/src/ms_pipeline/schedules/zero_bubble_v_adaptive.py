"""ZeroBubbleV ordered for measured costs (the idea of the Zero Bubble authors' greedy V scheduler,
sail-sg ``zbv.py``; written anew, not ported).

The fixed V pattern (zero_bubble_v.py) is zero-bubble only when T_F = T_B = T_W. With real costs
(the authors measured T_W = 0.63 T_F) the order should follow the clock, so this builder
list-schedules the same V placement with a cost model, one decision at a time on the rank whose
clock is earliest:

1. a B whose inputs have arrived goes first: B is on the critical path between ranks;
2. else an F whose input has arrived, if the rank's activation budget allows (by default the
   1F1B peak: p microbatches of the rank's share, i.e. 2p chunk-microbatches) and rank i is not
   already 2(p-i)-1 chunk-0 forwards ahead of its chunk-1 forwards (the fixed warm-up depth,
   which keeps room for the microbatches coming back up the V);
3. else a pending W: when the activation budget is full (it frees room), or to fill a wait --
   always, or only when it ends before the next F or B can start (both policies are tried);
4. else the rank waits for the earliest input.

Several policies are built and the shortest schedule under the cost model wins, the fixed pattern
included, so the result is never slower than :func:`zero_bubble_v` under those costs.
"""

from __future__ import annotations

from collections import deque

from ms_layout.limits import Limit

from ..errors import ScheduleError
from ..ir import Action, Kind, Schedule
from ..placement import stage_to_rank
from ..simulate import CostModel, simulate
from ._common import check_sizes
from .zero_bubble_v import zero_bubble_v

_INF = float("inf")

MAX_ADAPTIVE_WORK = Limit("MS_PIPELINE_MAX_ADAPTIVE_WORK", 1 << 13, "rank x stage x microbatch steps")
"""The greedy passes cost about ranks x stages x microbatches steps (plus five simulations): the
default keeps the search within a few seconds (p=8, m=64; p=64, m=1; p=1, m=4096)."""


class _Greedy:
    """One list-scheduling pass over the V placement."""

    def __init__(self, p: int, m: int, costs: CostModel, limit: int, fill_always: bool, b_chunk1_first: bool):
        self.p, self.m, self.costs, self.limit = p, m, costs, limit
        self.fill_always, self.b_chunk1_first = fill_always, b_chunk1_first
        self.placement = stage_to_rank(p, 2, "v")
        self.end: dict[tuple[int, Kind, int], float] = {}
        self.next = {(s, k): 0 for s in range(2 * p) for k in (Kind.F, Kind.B)}
        self.clock = [0.0] * p
        self.inflight = [0] * p
        self.pending_w: list[deque] = [deque() for _ in range(p)]
        self.acts: list[list[Action]] = [[] for _ in range(p)]
        self.left = [6 * m for _ in range(p)]  # F, B, W of two chunks

    def stages(self, r: int) -> tuple[int, int]:
        return (r, 2 * self.p - 1 - r)

    def _input_time(self, stage: int, kind: Kind, mb: int) -> float | None:
        """When the inputs of (stage, kind, mb) are available here; None if not computed yet."""
        deps = []
        if kind is Kind.F and stage > 0:
            deps.append((stage - 1, Kind.F, mb))
        if kind is Kind.B:
            deps.append((stage, Kind.F, mb))
            if stage < 2 * self.p - 1:
                deps.append((stage + 1, Kind.B, mb))
        t = 0.0
        for dep in deps:
            if dep not in self.end:
                return None
            hop = self.costs.comm if self.placement[dep[0]] != self.placement[stage] else 0.0
            t = max(t, self.end[dep] + hop)
        return t

    def _candidates(self, r: int, kind: Kind) -> list[tuple[float, int, int]]:
        """(input time, stage, microbatch) of the next F or B of each chunk of rank r."""
        out = []
        down, up = self.stages(r)
        lead = self.next[down, Kind.F] - self.next[up, Kind.F]
        for chunk, stage in enumerate((down, up)):
            mb = self.next[stage, kind]
            if mb >= self.m or (kind is Kind.B and mb >= self.next[stage, Kind.F]):
                continue
            if kind is Kind.F and chunk == 0 and lead >= 2 * (self.p - r) - 1:
                continue  # keep room for the chunk-1 forwards coming back up (the fixed warm-up depth)
            t = self._input_time(stage, kind, mb)
            order = chunk if kind is Kind.F or not self.b_chunk1_first else 1 - chunk
            out.append((_INF if t is None else t, -order if kind is Kind.F else order, stage, mb))
        return [(t, stage, mb) for t, _, stage, mb in sorted(out)]

    def _run(self, r: int, action: Action, start: float) -> None:
        duration = self.costs.duration(action)
        self.clock[r] = start + duration
        self.end[action.stage, action.kind, action.microbatch] = self.clock[r]
        self.acts[r].append(action)
        self.left[r] -= 1
        if action.kind is Kind.F:
            self.next[action.stage, Kind.F] += 1
            self.inflight[r] += 1
        elif action.kind is Kind.B:
            self.next[action.stage, Kind.B] += 1
            self.pending_w[r].append(action)
        else:
            self.inflight[r] -= 1

    def _run_w(self, r: int) -> None:
        b = self.pending_w[r].popleft()
        self._run(r, Action(b.stage, Kind.W, b.microbatch), self.clock[r])

    def step(self, r: int) -> bool:
        """Decide rank r's next action or wait; False if r can do nothing before another rank moves."""
        now = self.clock[r]
        bs = self._candidates(r, Kind.B)
        if bs and bs[0][0] <= now:
            _, stage, mb = bs[0]
            self._run(r, Action(stage, Kind.B, mb), now)
            return True
        if self.inflight[r] >= self.limit and self.pending_w[r]:
            self._run_w(r)  # the activation budget is full: a W frees room for the next F
            return True
        fs = self._candidates(r, Kind.F) if self.inflight[r] < self.limit else []
        ready_f = [c for c in fs if c[0] <= now]
        if ready_f:
            # the chunk-1 F (already on its way back up the V) first: it leads to a B sooner
            _, stage, mb = ready_f[0]
            self._run(r, Action(stage, Kind.F, mb), now)
            return True
        known = [c[0] for c in bs + fs if c[0] < _INF]
        soon = min(known, default=_INF)
        if self.pending_w[r]:
            w = self.costs.at("w", self.pending_w[r][0].stage)
            if self.fill_always or now + w <= soon or soon == _INF:
                self._run_w(r)
                return True
        if soon < _INF:
            self.clock[r] = soon  # idle until the earliest input arrives
            return True
        # inputs not computed yet: wait until the next rank moves
        later = [self.clock[q] for q in range(self.p) if self.left[q] > 0 and self.clock[q] > now]
        if later and all(self.clock[q] > now for q in range(self.p) if q != r and self.left[q] > 0):
            self.clock[r] = min(later)
            return True
        return False

    def build(self) -> list[list[Action]]:
        while any(self.left):
            active = sorted((r for r in range(self.p) if self.left[r] > 0), key=lambda q: (self.clock[q], q))
            if not any(self.step(r) for r in active):
                raise ScheduleError("adaptive ZeroBubbleV: no rank can move (internal error)")
        return self.acts


def zero_bubble_v_adaptive(
    num_ranks: int, num_microbatches: int, costs: CostModel | None = None, memory_limit: int | None = None
) -> Schedule:
    """ZeroBubbleV ordered for ``costs`` (per stage, i.e. already split in two chunks per rank;
    default: equal costs). ``memory_limit``: chunk-microbatches alive per rank (default 2p, the
    1F1B peak). Returns the fastest of the greedy orders and the fixed pattern under ``costs``."""
    check_sizes("zbv-adaptive", num_ranks, num_microbatches, 2)
    p, m = num_ranks, num_microbatches
    # Each greedy pass looks at every rank for every action: p x (2p x m) steps, four passes.
    MAX_ADAPTIVE_WORK.check(
        p * 2 * p * m, f"zbv-adaptive search {p} ranks x {2 * p} stages x {m} microbatches", ScheduleError
    )
    costs = costs or CostModel().split(2)
    limit = 2 * p if memory_limit is None else memory_limit
    if limit < 2:
        raise ScheduleError(f"memory_limit={limit} must let a rank hold at least both chunks of one microbatch")
    best = zero_bubble_v(p, m)
    best_time = simulate(best, costs).makespan
    for fill_always in (False, True):
        for b_chunk1_first in (True, False):
            acts = _Greedy(p, m, costs, limit, fill_always, b_chunk1_first).build()
            candidate = Schedule("zbv", 2 * p, m, stage_to_rank(p, 2, "v"), acts)
            t = simulate(candidate, costs).makespan
            if t < best_time - 1e-12:
                best, best_time = candidate, t
    return best
