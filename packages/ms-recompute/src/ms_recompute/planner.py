"""Choose what to recompute: the least recompute time whose peak activation memory fits a budget.

Each layer offers options -- keep everything, recompute a subset of its sub-modules, recompute it
whole -- each with the bytes it keeps until the backward, the bytes its recompute materialises at
once (the working set), and the time the recompute takes. A plan picks one option per layer; its
peak is ``sum(kept) + max(working)``, because recompute groups run one after another in the
backward and each frees what it recomputed as its backward consumes it.

``exact`` solves this multiple-choice knapsack exactly: for every candidate working-set size w
(few distinct values), a dynamic program over the layers keeps the Pareto frontier of (kept bytes,
time) among options whose working set is at most w, under ``budget - w``; the best over all w wins.
Frontiers stay small for decoder stacks (layers repeat a handful of distinct options), but they
can grow with many heterogeneous layers, so past ``max_states`` frontier points ``auto`` falls back
to ``greedy``: start with nothing recomputed and repeatedly take the option change with the most
peak bytes saved per second of recompute added, until the budget holds. Greedy is not optimal
(a knapsack has no greedy guarantee) and is marked as such in the plan.

With ``overlap``, fully recomputed layers run in pairs, so a full option's working set is counted
as its own activations plus the largest of any layer (an upper bound: the partner's recompute is
held until its backward). The time saved by the overlap is not part of the objective: it is
measured, not modelled (benchmarks/bench_recompute.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

from .errors import RecomputeError
from .limits import MAX_EXACT_WORK
from .memory import LAYER_MODULES, LayerMemory
from .plan import Granularity, LayerPlan, Prediction, RecomputePlan

METHODS = ("auto", "exact", "greedy")


@dataclass(frozen=True)
class Option:
    """One way to run one layer."""

    choice: LayerPlan
    """What it recomputes."""
    kept_bytes: int
    """Activation bytes kept until the backward."""
    working_bytes: int
    """Bytes its recompute materialises at once (0 if nothing is recomputed)."""
    recompute_s: float
    """Time its recompute adds to the backward."""


def layer_options(
    mem: LayerMemory,
    *,
    flops_per_s: float,
    comm_s: float = 0.0,
    comms: int = 1,
    granularities: Sequence[str] = ("none", "selective", "full"),
    modules: Sequence[str] = LAYER_MODULES,
) -> list[Option]:
    """The options of one layer from its analytic memory: recompute time is forward FLOPs over
    ``flops_per_s``, plus ``comms`` collectives of ``comm_s`` seconds for a full (TP) recompute."""
    if not flops_per_s > 0:
        raise RecomputeError(f"flops_per_s={flops_per_s!r}; expected a positive rate")
    unknown = set(granularities) - {"none", "selective", "full"}
    if unknown or not granularities:
        raise RecomputeError(f"granularities {list(granularities)}; choose from none, selective, full")
    i, total = mem.index, mem.total_bytes
    out = []
    if "none" in granularities:
        out.append(Option(LayerPlan(i), total, 0, 0.0))
    if "selective" in granularities:
        parts = [mem.module(m) for m in modules]
        for k in range(1, len(parts) + 1):
            for subset in combinations(parts, k):
                freed = sum(m.activation_bytes for m in subset)
                out.append(
                    Option(
                        LayerPlan(i, Granularity.SELECTIVE, tuple(m.name for m in subset)),
                        total - freed,
                        max(m.activation_bytes for m in subset),
                        sum(m.flops for m in subset) / flops_per_s,
                    )
                )
    if "full" in granularities:
        time = mem.flops / flops_per_s + (comms * comm_s if mem.comm_bytes else 0.0)
        out.append(Option(LayerPlan(i, Granularity.FULL), mem.input_bytes, total - mem.input_bytes, time))
    return out


def _peak(chosen: Sequence[Option]) -> int:
    return sum(o.kept_bytes for o in chosen) + max((o.working_bytes for o in chosen), default=0)


class _TooLarge(Exception):
    """The exact frontier outgrew max_states."""


def _frontier(
    options: Sequence[Sequence[Option]], cap: int, max_states: int, work: list[int] | None = None
) -> list[Option] | None:
    """Least-time choice with sum(kept) <= cap (None if none fits), by a Pareto-frontier DP.
    ``work`` counts the states grown (across calls); over MS_RECOMPUTE_MAX_EXACT_WORK it gives up."""
    # A state is (kept, time, chosen options as a linked tuple); only non-dominated states survive.
    states: list[tuple[int, float, tuple]] = [(0, 0.0, ())]
    for layer_options_ in options:
        if work is not None:
            work[0] += len(states) * len(layer_options_)
            if work[0] > MAX_EXACT_WORK.value:
                raise _TooLarge
        grown = [(k + o.kept_bytes, t + o.recompute_s, (chosen, o)) for k, t, chosen in states for o in layer_options_]
        grown = [s for s in grown if s[0] <= cap]
        if not grown:
            return None
        grown.sort(key=lambda s: (s[0], s[1]))
        states = []
        for s in grown:
            if not states or s[1] < states[-1][1]:
                states.append(s)
        if len(states) > max_states:
            raise _TooLarge
    _, _, linked = min(states, key=lambda s: (s[1], s[0]))
    chosen: list[Option] = []
    while linked:
        linked, o = linked
        chosen.append(o)
    return chosen[::-1]


def solve_exact(options: Sequence[Sequence[Option]], budget_bytes: int, max_states: int = 200_000) -> list[Option]:
    """The least-time choice of one option per layer with peak <= budget (RecomputeError if none)."""
    best: list[Option] | None = None
    work = [0]
    for w in sorted({o.working_bytes for opts in options for o in opts}):
        allowed = [[o for o in opts if o.working_bytes <= w] for opts in options]
        if any(not a for a in allowed) or budget_bytes - w < 0:
            continue
        chosen = _frontier(allowed, budget_bytes - w, max_states, work)
        if chosen is None:
            continue
        key = (sum(o.recompute_s for o in chosen), _peak(chosen))
        if best is None or key < (sum(o.recompute_s for o in best), _peak(best)):
            best = chosen
    if best is None:
        raise _infeasible(options, budget_bytes)
    return best


def solve_greedy(options: Sequence[Sequence[Option]], budget_bytes: int) -> list[Option]:
    """Start from the fastest option of every layer; take the change with the most peak bytes saved
    per second added until the peak fits (RecomputeError if no change helps any more)."""
    chosen = [min(opts, key=lambda o: (o.recompute_s, o.kept_bytes)) for opts in options]
    while _peak(chosen) > budget_bytes:
        now, best, best_ratio = _peak(chosen), None, -1.0
        # The peak of each trial (layer i changed to o) from totals, in O(1) instead of a copy and a
        # sum per trial: the same integers, so the same choices, without the cubic cost in layers.
        kept = sum(c.kept_bytes for c in chosen)
        works = sorted((c.working_bytes for c in chosen), reverse=True)
        top, second = works[0], works[1] if len(works) > 1 else 0
        for i, opts in enumerate(options):
            others = second if chosen[i].working_bytes == top else top
            for o in opts:
                trial_peak = kept - chosen[i].kept_bytes + o.kept_bytes + max(others, o.working_bytes)
                saved, added = now - trial_peak, o.recompute_s - chosen[i].recompute_s
                if saved <= 0:
                    continue
                ratio = float("inf") if added <= 0 else saved / added
                if ratio > best_ratio:
                    best, best_ratio = (i, o), ratio
        if best is None:
            raise _infeasible(options, budget_bytes)
        chosen[best[0]] = best[1]
    return chosen


def lowest_peak(options: Sequence[Sequence[Option]]) -> int:
    """The smallest peak any choice reaches: over each working-set cap w, the least kept bytes plus w."""
    best = None
    for w in sorted({o.working_bytes for opts in options for o in opts}):
        allowed = [[o.kept_bytes for o in opts if o.working_bytes <= w] for opts in options]
        if all(allowed):
            peak = sum(min(a) for a in allowed) + w
            best = peak if best is None else min(best, peak)
    return 0 if best is None else best


def _infeasible(options: Sequence[Sequence[Option]], budget_bytes: int) -> RecomputeError:
    return RecomputeError(
        f"budget {budget_bytes} bytes is below the lowest peak any plan reaches, {lowest_peak(options)} bytes"
    )


def plan_recompute(
    layers: Sequence[LayerMemory],
    budget_bytes: int,
    *,
    flops_per_s: float = 1e12,
    comm_s: float = 0.0,
    overlap: bool = False,
    comms: int = 1,
    method: str = "auto",
    granularities: Sequence[str] = ("none", "selective", "full"),
    max_states: int = 200_000,
) -> RecomputePlan:
    """The plan of least recompute time whose peak activation memory fits ``budget_bytes``."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise RecomputeError(f"budget_bytes={budget_bytes!r}; expected an int >= 0")
    if method not in METHODS:
        raise RecomputeError(f"method={method!r}; expected one of {METHODS}")
    if not layers:
        raise RecomputeError("no layers to plan for")
    if [m.index for m in layers] != list(range(len(layers))):
        raise RecomputeError(f"layers must be 0..{len(layers) - 1} in order, got {[m.index for m in layers]}")
    options = [
        layer_options(m, flops_per_s=flops_per_s, comm_s=comm_s, comms=comms, granularities=granularities)
        for m in layers
    ]
    if overlap:
        # a pair holds its partner's recompute until the partner's backward: count the largest layer on top
        extra = max(m.total_bytes - m.input_bytes for m in layers)
        options = [
            [
                Option(o.choice, o.kept_bytes, o.working_bytes + extra, o.recompute_s)
                if o.choice.granularity is Granularity.FULL
                else o
                for o in opts
            ]
            for opts in options
        ]
    used = method
    if method in ("auto", "exact"):
        try:
            chosen = solve_exact(options, budget_bytes, max_states)
            used = "exact"
        except _TooLarge:
            if method == "exact":
                raise RecomputeError(
                    f"the exact frontier exceeded max_states={max_states} or {MAX_EXACT_WORK.value} states grown"
                    f" (raise it with {MAX_EXACT_WORK.env}=N); use method='greedy'"
                ) from None
            chosen, used = solve_greedy(options, budget_bytes), "greedy"
    else:
        chosen = solve_greedy(options, budget_bytes)
    prediction = Prediction(
        baseline_bytes=sum(m.total_bytes for m in layers),
        kept_bytes=sum(o.kept_bytes for o in chosen),
        working_bytes=max(o.working_bytes for o in chosen),
        recompute_s=sum(o.recompute_s for o in chosen),
        budget_bytes=budget_bytes,
        method=used,
    )
    return RecomputePlan(tuple(o.choice for o in chosen), overlap=overlap, comms=comms, prediction=prediction)


def predict(
    plan: RecomputePlan, layers: Sequence[LayerMemory], *, flops_per_s: float = 1e12, comm_s: float = 0.0
) -> Prediction:
    """The planner's numbers for any plan (one written by hand included)."""
    if plan.num_layers != len(layers):
        raise RecomputeError(f"the plan covers {plan.num_layers} layers, the model has {len(layers)}")
    extra = max(m.total_bytes - m.input_bytes for m in layers) if plan.overlap else 0
    kept = working = 0
    time = 0.0
    for lp, mem in zip(plan.layers, layers):
        if lp.granularity is Granularity.NONE:
            kept += mem.total_bytes
        elif lp.granularity is Granularity.FULL:
            kept += mem.input_bytes
            working = max(working, mem.total_bytes - mem.input_bytes + extra)
            time += mem.flops / flops_per_s + (plan.comms * comm_s if mem.comm_bytes else 0.0)
        else:
            parts = [mem.module(name) for name in lp.modules]
            kept += mem.total_bytes - sum(m.activation_bytes for m in parts)
            working = max(working, *(m.activation_bytes for m in parts))
            time += sum(m.flops for m in parts) / flops_per_s
    return Prediction(sum(m.total_bytes for m in layers), kept, working, time, None, "manual")
