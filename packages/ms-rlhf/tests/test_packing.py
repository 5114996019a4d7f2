"""The packer: limits hold, nothing is truncated, the pack count is minimal on small inputs
(checked against an exhaustive search) and never worse than the next-fit baseline."""

from __future__ import annotations

import itertools
from functools import cache

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_rlhf import PackingError, PackPlan, lower_bound, next_fit, pack, plan_packs, token_bound


def optimum(lengths, cap, count):
    """Fewest packs, by dynamic programming over subsets (independent of the packer)."""
    n = len(lengths)
    feasible = [
        sum(lengths[i] for i in range(n) if m >> i & 1) <= cap and bin(m).count("1") <= count for m in range(1 << n)
    ]

    @cache
    def best(mask):
        if mask == 0:
            return 0
        low = mask & -mask
        rest = mask ^ low
        out, sub = n + 1, rest
        while True:  # every subset of `rest`, plus the lowest item
            if feasible[sub | low]:
                out = min(out, 1 + best(mask ^ (sub | low)))
            if sub == 0:
                break
            sub = (sub - 1) & rest
        return out

    return best((1 << n) - 1)


def check_plan(lengths, cap, count, packs):
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    for p in packs:
        assert sum(lengths[i] for i in p) <= cap
        assert len(p) <= (count or len(lengths))


cases = st.integers(1, 40).flatmap(
    lambda cap: st.tuples(
        st.just(cap),
        st.lists(st.integers(1, cap), min_size=1, max_size=9),
        st.one_of(st.none(), st.integers(1, 5)),
    )
)


@settings(max_examples=150, deadline=None)
@given(cases)
def test_pack_is_minimal_on_small_inputs(case):
    cap, lengths, count = case
    packs = pack(lengths, cap, count)
    check_plan(lengths, cap, count, packs)
    assert len(packs) == optimum(tuple(lengths), cap, count or len(lengths))
    plan = plan_packs(lengths, cap, count)
    assert plan.optimal
    assert token_bound(lengths, cap) <= plan.lower_bound <= plan.num_packs


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=300), st.integers(200, 600), st.integers(1, 12))
def test_large_inputs_respect_limits_and_beat_next_fit(lengths, cap, count):
    plan = plan_packs(lengths, cap, count)
    check_plan(lengths, cap, count, plan.packs)
    assert plan.lower_bound <= plan.num_packs <= len(next_fit(lengths, cap, count))
    assert plan.lower_bound == lower_bound(lengths, cap, count)


def test_skewed_batch_is_close_to_the_bound():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(300), 0.8, 256).astype(int), 16, 2048).tolist()
    plan = plan_packs(lengths, 4096, 64)
    assert plan.num_packs <= plan.token_bound + 1
    assert plan.fill() > 0.9


def test_too_long_sample_is_an_error_naming_it():
    with pytest.raises(PackingError, match=r"sample 2 has 11 tokens, more than max_pack_len=10"):
        pack([3, 4, 11, 2], 10, 4)
    with pytest.raises(PackingError, match="sample 1 has length 0"):
        pack([3, 0], 10)
    with pytest.raises(PackingError, match="max_pack_count=0"):
        pack([3], 10, 0)
    with pytest.raises(PackingError, match="max_pack_len"):
        pack([3], 0)


def test_count_limit_binds():
    assert len(pack([1] * 10, 100, 3)) == 4
    assert len(pack([1] * 10, 100)) == 1


def test_pack_carries_cu_seqlens_positions_and_sample_ids():
    plan = plan_packs([3, 2, 4], 9)
    assert plan.packs == ((0, 1, 2),)
    p = plan.pack(0)
    assert p.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert p.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert p.segment_ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert p.token_sample_ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    padded = p.layout(pad_to=12)
    assert padded["segment_ids"][-3:].tolist() == [3, 3, 3]
    assert padded["token_sample_ids"][-3:].tolist() == [-1, -1, -1]


def test_plan_round_trips_and_validates():
    plan = plan_packs([5, 9, 2, 7, 3], 12, 2)
    blob = msgpack.packb(plan.to_dict())
    assert PackPlan.from_dict(msgpack.unpackb(blob)) == plan
    bad = plan.to_dict()
    bad["packs"] = [[0, 1, 2, 3, 4]]
    with pytest.raises(PackingError, match="limits"):
        PackPlan.from_dict(bad)
    assert "lower bound" in str(plan)
    import ms_layout

    assert ms_layout.loads(ms_layout.dumps(plan), expect="PackPlan") == plan


def test_exhaustive_reference_agrees_with_brute_force():
    # the DP reference itself, against trying every assignment of 6 items to bins
    lengths, cap = (4, 3, 3, 2, 2, 2), 6
    brute = min(
        len(set(a))
        for a in itertools.product(range(6), repeat=6)
        if all(sum(lengths[i] for i in range(6) if a[i] == b) <= cap for b in set(a))
    )
    assert optimum(lengths, cap, 6) == brute == 3
