"""The planner: exact against brute force, the greedy fallback, budgets, and predictions."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_recompute import (
    Granularity,
    LayerPlan,
    Option,
    RecomputeError,
    RecomputePlan,
    Shape,
    layer_options,
    lowest_peak,
    model_memory,
    plan_recompute,
    predict,
)
from ms_recompute.planner import solve_exact, solve_greedy

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def peak(chosen):
    return sum(o.kept_bytes for o in chosen) + max(o.working_bytes for o in chosen)


def time_of(chosen):
    return sum(o.recompute_s for o in chosen)


option = st.builds(
    lambda k, w, t: Option(LayerPlan(0), k, w, t),
    st.integers(0, 60),
    st.integers(0, 30),
    st.integers(0, 20).map(float),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(option, min_size=1, max_size=4), min_size=1, max_size=4), st.integers(0, 200))
def test_exact_equals_brute_force(options, budget):
    feasible = [c for c in itertools.product(*options) if peak(c) <= budget]
    if not feasible:
        with pytest.raises(RecomputeError, match="below the lowest peak"):
            solve_exact(options, budget)
        assert lowest_peak(options) > budget
        return
    best = min(time_of(c) for c in feasible)
    chosen = solve_exact(options, budget)
    assert peak(chosen) <= budget
    assert time_of(chosen) == best
    greedy = solve_greedy(options, budget)  # feasible, never better than exact
    assert peak(greedy) <= budget and time_of(greedy) >= best


def test_budget_sweep_moves_from_nothing_to_selective_to_full():
    layers = model_memory(LLAMA, Shape(2, 64))
    baseline = sum(m.total_bytes for m in layers)
    roomy = plan_recompute(layers, baseline)
    assert roomy.spec == "" and roomy.prediction.recompute_s == 0
    times, specs = [], []
    for fraction in (0.9, 0.7, 0.5, 0.3):
        plan = plan_recompute(layers, int(baseline * fraction))
        assert plan.prediction.peak_bytes <= baseline * fraction
        assert plan.prediction.method == "exact"
        times.append(plan.prediction.recompute_s)
        specs.append(plan.spec)
    assert times == sorted(times)  # a tighter budget never costs less time
    assert "full" not in specs[0] and any(lp != "" for lp in specs)
    with pytest.raises(RecomputeError, match="below the lowest peak"):
        plan_recompute(layers, 1000)


def test_prediction_agrees_with_predict_and_overlap_doubles_the_working_set():
    layers = model_memory(LLAMA, Shape(2, 64))
    plan = plan_recompute(layers, int(sum(m.total_bytes for m in layers) * 0.4))
    again = predict(plan, layers)
    assert (again.kept_bytes, again.working_bytes) == (plan.prediction.kept_bytes, plan.prediction.working_bytes)
    assert again.recompute_s == pytest.approx(plan.prediction.recompute_s)
    full = RecomputePlan.uniform(4, Granularity.FULL)
    paired = RecomputePlan.uniform(4, Granularity.FULL, overlap=True)
    one = layers[0].total_bytes - layers[0].input_bytes
    assert predict(full, layers).working_bytes == one
    assert predict(paired, layers).working_bytes == 2 * one


def test_selective_options_free_module_activations_and_full_keeps_only_the_input():
    mem = model_memory(LLAMA, Shape(2, 8))[0]
    options = {o.choice.label: o for o in layer_options(mem, flops_per_s=1e9)}
    assert len(options) == 1 + 15 + 1  # none, every non-empty subset of 4 modules, full
    assert options["none"].kept_bytes == mem.total_bytes and options["none"].recompute_s == 0
    assert options["mlp"].kept_bytes == mem.total_bytes - mem.module("mlp").activation_bytes
    assert options["full"].kept_bytes == mem.input_bytes
    assert options["full"].recompute_s == pytest.approx(mem.flops / 1e9)


def test_greedy_fallback_when_the_frontier_is_too_large():
    layers = model_memory(LLAMA, Shape(2, 64))
    budget = int(sum(m.total_bytes for m in layers) * 0.5)
    plan = plan_recompute(layers, budget, max_states=1)
    assert plan.prediction.method == "greedy" and plan.prediction.peak_bytes <= budget
    with pytest.raises(RecomputeError, match="max_states"):
        plan_recompute(layers, budget, method="exact", max_states=1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"budget_bytes": -1}, "budget_bytes"),
        ({"budget_bytes": 10**9, "method": "ilp"}, "method"),
        ({"budget_bytes": 10**9, "flops_per_s": 0}, "flops_per_s"),
        ({"budget_bytes": 10**9, "granularities": ("some",)}, "granularities"),
    ],
)
def test_bad_planner_input_is_named(kwargs, match):
    with pytest.raises(RecomputeError, match=match):
        plan_recompute(model_memory(LLAMA, Shape(1, 8)), **kwargs)
