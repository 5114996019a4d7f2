"""Multicast rows: one row per (piece, sender) instead of one transfer per receiver.

The same properties as the point-to-point planner (test_planner_properties.py), on plans forced to
use multicasts (multicast_min=0), plus the size they keep at scale."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from strategies import layout_pairs, lower_bound_by_masks, shards_of

from ms_layout import Layout
from ms_reshard import apply_local, plan
from ms_reshard.checkpoint import read_rank  # noqa: F401  (the reader's public entry point stays importable)
from ms_reshard.serialize import plan_from_bytes, plan_to_bytes
from ms_reshard.validate import validate


def _global(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@settings(max_examples=200, deadline=None)
@given(layout_pairs())
def test_multicast_plans_give_target_shards_at_the_lower_bound(case):
    src, dst, shape = case
    p = plan(src, dst, shape, itemsize=2, multicast_min=0)
    q = plan(src, dst, shape, itemsize=2, multicast_min=None)
    assert p.multicast is not None or 0 in shape
    x = _global(shape)
    out, want = apply_local(p, shards_of(x, src)), shards_of(x, dst)
    assert set(out) == set(want)
    for r in want:
        np.testing.assert_array_equal(out[r], want[r])
    validate(p)
    masks = lower_bound_by_masks(src, dst, shape)
    for row in p.per_rank():
        assert row["received"] == row["lower_bound"] == 2 * masks.get(row["rank"], 0)
    assert p.sent.sum() == p.received.sum() == q.received.sum()


@settings(max_examples=100, deadline=None)
@given(layout_pairs())
def test_multicast_op_lists_agree_and_serialize(case):
    src, dst, shape = case
    p = plan(src, dst, shape, multicast_min=0)
    by_rank = p.ops_by_rank()
    for r in p.ranks:
        assert p.rank_ops(int(r)) == by_rank[int(r)]
    q = plan_from_bytes(plan_to_bytes(p))
    assert q.ops_by_rank() == by_rank and str(q) == str(p)
    # the offline reader's view: every target rank gets every element of its shard from somewhere
    for pieces in p.sources_by_rank().values():
        got = sum(int(np.prod([b - a for a, b in box])) for _, box in pieces)
        assert got == int(np.prod(dst.shard_shape(shape)))


def test_replicated_target_stays_small_at_scale():
    # ZeRO-sharded on one 64-rank stage -> whole on 1024 ranks: 64 pieces, each from its one holder
    src = Layout((64,), ("dp",), rank_list=tuple(range(64)))("dp", "None")
    dst = Layout((1024,), ("dp",))("None", "None")
    p = plan(src, dst, (1024, 256), itemsize=2)
    assert p.multicast is not None and len(p.multicast) == 64 and len(p.xfer_src) == 0
    assert (p.received == p.lower_bound).all() and p.bytes_moved() == (1024 - 1) * 1024 * 256 * 2
    assert len(p.transfers()[0]) == 64 * 1023  # what the point-to-point plan would store
    q = plan(src, dst, (1024, 256), itemsize=2, multicast_min=None)
    assert len(q.xfer_src) == 64 * 1023 and q.bytes_moved() == p.bytes_moved()
    # rank 100 receives the 64 pieces, one from each holder, in row order
    ops = p.rank_ops(100)
    assert [op.peer for op in ops] == list(range(64)) and all(op.kind.value == "recv" for op in ops)


def test_senders_share_a_pieces_receivers_in_rank_order():
    # each source chunk has 2 holders: the replicas of the target are split in two blocks
    src = Layout((2, 2), ("dp", "tp"))("tp", "None")
    dst = Layout((8,), ("dp",), rank_list=tuple(range(4, 12)))("None", "None")
    p = plan(src, dst, (4, 2), multicast_min=0)
    mc = p.multicast
    assert len(mc) == 4
    senders = {int(p.ranks[s]): (int(a), int(b)) for s, a, b in zip(mc.src, mc.lo, mc.hi)}
    assert senders == {0: (0, 4), 1: (0, 4), 2: (4, 8), 3: (4, 8)}
    assert (p.sent[:4] == 4 * 4 * 4).all()


def test_a_complete_exchange_stays_an_all_gather():
    # ZeRO over 256 ranks -> whole on the same ranks: each rank's piece goes to all others, which
    # step 4 makes an all-gather; multicast rows would move the same bytes without the collective
    lay = Layout((256,), ("dp",))
    p = plan(lay("dp", "None"), lay("None", "None"), (256, 4))
    assert p.multicast is None and [c.kind.value for c in p.collectives] == ["all_gather"]
    assert (p.received == p.lower_bound).all()
    q = plan(lay("dp", "None"), lay("None", "None"), (256, 4), collectives=False)
    assert q.multicast is not None and len(q.multicast) == 256 and q.bytes_moved() == p.bytes_moved()


def test_executor_op_lists_are_kept_per_plan_object_not_per_shared_arrays():
    # a relabeled plan (another pipeline stage) shares the arrays of the first but not its peers
    from ms_reshard.exchange import _static

    src = Layout((2,), ("tp",))("tp", "None")
    p = plan(src, Layout((2,), ("tp",), rank_list=(2, 3))("None", "tp"), (4, 4))
    q = p.relabel(p.src, Layout((2,), ("tp",), rank_list=(4, 5))("None", "tp"), np.array([0, 1, 4, 5]))
    assert q.xfer_src is p.xfer_src
    assert {op.peer for op in _static(p, 0, True, False)[0]} == {2, 3}
    assert {op.peer for op in _static(q, 0, True, False)[0]} == {4, 5}
