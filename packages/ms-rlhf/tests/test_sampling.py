"""Uniform sampling spreads every group over the instances; restore() brings groups back;
the length-aware balancer keeps request counts equal and beats or ties its components."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_rlhf import (
    Assignment,
    RLHFError,
    balanced_split,
    contiguous_split,
    karmarkar_karp,
    lpt,
    makespan,
    partition,
    split,
    uniform_split,
)

sizes = st.tuples(st.integers(1, 12), st.integers(1, 9), st.integers(1, 6))


@settings(max_examples=200, deadline=None)
@given(sizes)
def test_uniform_spreads_each_group_evenly(size):
    prompts, n, dp = size
    a = uniform_split(prompts, n, dp)
    spread = a.group_spread(n)
    assert (spread.max(axis=1) - spread.min(axis=1) <= 1).all()
    counts = [len(i) for i in a.instances]
    assert max(counts) - min(counts) <= 1


@settings(max_examples=200, deadline=None)
@given(sizes, st.sampled_from(["contiguous", "uniform", "balanced"]), st.randoms(use_true_random=False))
def test_restore_is_the_inverse_permutation(size, strategy, rnd):
    prompts, n, dp = size
    costs = [rnd.randint(1, 50) for _ in range(prompts * n)]
    a = split(strategy, prompts, n, dp, costs)
    outputs = [[f"out{r}" for r in inst] for inst in a.instances]  # what each instance returns
    assert a.restore(outputs) == [f"out{r}" for r in range(prompts * n)]
    assert Assignment.from_dict(a.to_dict()) == a
    import ms_layout

    assert ms_layout.loads(ms_layout.dumps(a), expect="Assignment") == a


def test_contiguous_keeps_groups_together():
    a = contiguous_split(4, 4, 4)
    assert (a.group_spread(4) == 4 * np.eye(4, dtype=int)).all()
    u = uniform_split(4, 4, 4)
    assert (u.group_spread(4) == 1).all()


def test_uniform_balances_prompt_dependent_lengths():
    # prompt p's answers are all 10 * (p + 1) long: contiguous puts the longest group on one instance
    prompts, n, dp = 8, 4, 4
    costs = [10 * (r // n + 1) for r in range(prompts * n)]
    c, u = contiguous_split(prompts, n, dp), uniform_split(prompts, n, dp)
    assert u.makespan(costs) == sum(costs) / dp < c.makespan(costs)


def brute_makespan(costs, k):
    return min(
        makespan(costs, [[i for i, a in enumerate(assign) if a == j] for j in range(k)])
        for assign in itertools.product(range(k), repeat=len(costs))
    )


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=8), st.integers(1, 3))
def test_partition_within_graham_bound_of_optimum(costs, k):
    parts = partition(costs, k)
    assert sorted(i for p in parts for i in p) == list(range(len(costs)))
    opt = brute_makespan(costs, k)
    assert makespan(costs, parts) <= (4 / 3) * opt + 1e-9  # LPT's bound; we never do worse than LPT
    assert makespan(costs, parts) <= makespan(costs, karmarkar_karp(costs, k))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 1000), min_size=1, max_size=60), st.integers(1, 8))
def test_equal_size_partition(costs, k):
    parts = partition(costs, k, equal_size=True)
    counts = [len(p) for p in parts]
    assert max(counts) - min(counts) <= 1
    assert (
        makespan(costs, parts)
        <= min(makespan(costs, karmarkar_karp(costs, k, True)), makespan(costs, lpt(costs, k, True))) + 1e-9
    )


def test_balanced_split_beats_contiguous_on_skewed_lengths():
    rng = np.random.default_rng(1)
    per_prompt = rng.lognormal(4, 1, 16)
    costs = np.repeat(per_prompt, 8)  # predicted per prompt, 8 samples each
    b = balanced_split(costs, 4)
    assert b.makespan(costs) <= uniform_split(16, 8, 4).makespan(costs) + 1e-9
    assert b.makespan(costs) < contiguous_split(16, 8, 4).makespan(costs)
    assert sorted(len(i) for i in b.instances) == [32] * 4


def test_errors_name_the_bad_value():
    with pytest.raises(RLHFError, match="dp=0"):
        uniform_split(2, 2, 0)
    with pytest.raises(RLHFError, match="unknown sampling strategy 'zigzag'"):
        split("zigzag", 2, 2, 2)
    with pytest.raises(RLHFError, match="cost of item 1"):
        partition([1.0, -2.0], 2)
    with pytest.raises(RLHFError, match="exactly once"):
        Assignment(((0, 1), (1,)), 2)
    with pytest.raises(RLHFError, match="instance 1 returned 0 outputs"):
        uniform_split(1, 2, 2).restore([["a"], []])
