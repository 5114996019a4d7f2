"""Property tests: a plan turns the source shards of a random tensor into exactly the target shards."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import layout_pairs, lower_bound_by_masks, shards_of

from ms_reshard import OpKind, apply_local, plan
from ms_reshard.serialize import plan_from_bytes, plan_to_bytes
from ms_reshard.validate import validate


def _global(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@settings(max_examples=300, deadline=None)
@given(layout_pairs())
def test_apply_local_gives_target_shards(case):
    src, dst, shape = case
    x = _global(shape)
    p = plan(src, dst, shape)
    out = apply_local(p, shards_of(x, src))
    want = shards_of(x, dst)
    assert set(out) == set(want)
    for r in want:
        np.testing.assert_array_equal(out[r], want[r])
    validate(p)


@settings(max_examples=300, deadline=None)
@given(layout_pairs())
def test_each_rank_receives_exactly_its_lower_bound(case):
    src, dst, shape = case
    p = plan(src, dst, shape, itemsize=2)
    masks = lower_bound_by_masks(src, dst, shape)
    for row in p.per_rank():
        assert row["lower_bound"] == 2 * masks.get(row["rank"], 0)
        assert row["received"] == row["lower_bound"]
    # what is received was sent by someone, and only source ranks send
    assert p.sent.sum() == p.received.sum()
    assert all(row["sent"] == 0 for row in p.per_rank() if row["rank"] not in src.ranks)


@settings(max_examples=200, deadline=None)
@given(layout_pairs(), st.integers(1, 64))
def test_memory_cap_bounds_every_round(case, cap_elems):
    src, dst, shape = case
    p = plan(src, dst, shape, itemsize=4, mem_cap=4 * cap_elems)
    used: dict[tuple[int, int], int] = {}
    for rank, ops in p.ops_by_rank().items():
        for op in ops:
            if op.kind in (OpKind.SEND, OpKind.RECV):
                used[(rank, op.round)] = used.get((rank, op.round), 0) + 4 * math.prod(b - a for a, b in op.box)
            elif op.kind is not OpKind.COPY:
                col = p.collectives[op.index]
                used[(rank, op.round)] = used.get((rank, op.round), 0) + 4 * col.buffer_elems()
    assert max(used.values(), default=0) <= 4 * cap_elems
    x = _global(shape, 1)
    out = apply_local(p, shards_of(x, src))
    for r, want in shards_of(x, dst).items():
        np.testing.assert_array_equal(out[r], want)
    assert (p.received == p.lower_bound).all()  # rounds and blocks never add bytes
    validate(p)


@settings(max_examples=100, deadline=None)
@given(layout_pairs())
def test_serialized_plan_runs_the_same(case):
    src, dst, shape = case
    p = plan(src, dst, shape, mem_cap=64)
    q = plan_from_bytes(plan_to_bytes(p))
    assert q.ops_by_rank() == p.ops_by_rank()
    assert str(q) == str(p)
    x = _global(shape, 2)
    a, b = apply_local(p, shards_of(x, src)), apply_local(q, shards_of(x, src))
    for r in a:
        np.testing.assert_array_equal(a[r], b[r])


@settings(max_examples=100, deadline=None)
@given(layout_pairs(), st.integers(1, 50))
def test_plan_is_invariant_under_shifting_all_ranks(case, shift):
    src, dst, shape = case
    moved = [
        type(lay)(lay.device_matrix, lay.alias_names, lay.dims, tuple(r + shift for r in lay.ranks))
        for lay in (src, dst)
    ]
    p, q = plan(src, dst, shape), plan(*moved, shape)
    for name in ("copy_id", "copy_box", "xfer_src", "xfer_dst", "xfer_box", "received", "lower_bound"):
        np.testing.assert_array_equal(getattr(p, name), getattr(q, name))
    np.testing.assert_array_equal(p.ranks + shift, q.ranks)
