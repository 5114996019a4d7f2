"""Pairs of recomputed layers and the ping-pong order inside a pair (MindSpore 2.7's pass, as data)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ms_recompute import Op, RecomputeError, Step, check_order, pair_layers


def test_pairs_in_forward_order_and_an_odd_last_layer_alone():
    groups = pair_layers([0, 1, 2, 3, 5], comms=1)
    assert [g.layers for g in groups] == [(0, 1), (2, 3), (5,)]
    assert [g.paired for g in groups] == [True, True, False]
    assert [g.layers for g in pair_layers([0, 1, 2, 3], overlap=False)] == [(0,), (1,), (2,), (3,)]


def test_the_later_layer_leads_and_each_collective_runs_under_the_other_layers_compute():
    (pair,) = pair_layers([4, 5], comms=1)
    # b = 5 is reached first by the backward: its all-reduce runs while 4 computes, and 4's while 5 does
    assert " ".join(map(str, pair.order)) == "5c0 5>0 4c0 4>0 5<0 5c1 4<0 4c1"
    (alone,) = pair_layers([7], comms=2)
    assert " ".join(map(str, alone.order)) == "7c0 7>0 7<0 7c1 7>1 7<1 7c2"


def test_two_collectives_alternate_like_mindspores_control_edges():
    (pair,) = pair_layers([0, 1], comms=2)
    text = [str(s) for s in pair.order]
    # A.comm[k] before the users of B.comm[k]; B.comm[k] before the users of A.comm[k+1]
    assert text == "1c0 1>0 0c0 0>0 1<0 1c1 1>1 0<0 0c1 0>1 1<1 1c2 0<1 0c2".split()


@given(st.lists(st.integers(0, 40), unique=True, max_size=9).map(sorted), st.integers(0, 3), st.booleans())
def test_every_order_computes_issues_and_waits_in_a_valid_sequence(layers, comms, overlap):
    groups = pair_layers(layers, comms, overlap)
    assert [layer for g in groups for layer in g.layers] == layers
    for g in groups:
        check_order(g, comms)
        if g.paired:  # every issued collective has the partner's compute before its wait
            for i, s in enumerate(g.order):
                if s.op is Op.ISSUE:
                    wait = g.order.index(Step(s.layer, Op.WAIT, s.index))
                    assert any(t.op is Op.COMPUTE and t.layer != s.layer for t in g.order[i:wait])


@pytest.mark.parametrize(
    "layers, comms, match",
    [([1, 0], 1, "increasing"), ([0, 0], 1, "distinct"), ([0, 1], -1, "comms"), ([0], True, "comms")],
)
def test_bad_input_is_named(layers, comms, match):
    with pytest.raises(RecomputeError, match=match):
        pair_layers(layers, comms)


def test_check_order_catches_a_wait_after_its_use():
    (pair,) = pair_layers([0, 1], comms=1)
    broken = type(pair)(pair.layers, tuple(s for s in pair.order if str(s) != "1<0") + (Step(1, Op.WAIT, 0),))
    with pytest.raises(RecomputeError, match="out of order"):
        check_order(broken, 1)
