"""Stage-to-rank styles and user-chosen layer placement (uneven layers per stage)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ms_pipeline as mp
from ms_pipeline import LayerPlacement, ScheduleError


def test_stage_to_rank_styles():
    assert mp.stage_to_rank(4) == (0, 1, 2, 3)
    assert mp.stage_to_rank(4, 2, "loop") == (0, 1, 2, 3, 0, 1, 2, 3)
    assert mp.stage_to_rank(4, 2, "v") == (0, 1, 2, 3, 3, 2, 1, 0)  # rank i holds i and 2p-1-i
    assert mp.stage_to_rank(2, 3, "v") == (0, 1, 1, 0, 0, 1)
    with pytest.raises(ScheduleError, match="'w'"):
        mp.stage_to_rank(2, 2, "w")


def test_uneven_layer_counts():
    lp = LayerPlacement.from_counts([3, 4, 4, 3])
    assert lp.num_stages == 4 and lp.num_layers == 14
    assert list(lp.layers(1)) == [3, 4, 5, 6] and lp.stage_of(13) == 3
    assert LayerPlacement.parse("3,4,4,3") == lp
    assert LayerPlacement.even(14, 4, first=3, last=3) == lp
    assert LayerPlacement.even(10, 4).counts == (3, 3, 2, 2)  # leftovers go to the earliest stages
    with pytest.raises(ScheduleError, match="stage 1 would hold no layers"):
        LayerPlacement.from_counts([2, 0, 2])
    with pytest.raises(ScheduleError, match="cannot place 4 layers on 4 stages with first=2"):
        LayerPlacement.even(4, 4, first=2, last=1)
    with pytest.raises(ScheduleError, match="layer 14 is outside"):
        lp.stage_of(14)


def test_balanced_placement_offsets_heavy_embedding_and_head():
    costs = [3.0] + [1.0] * 6 + [3.0]  # embedding-heavy first layer, head-heavy last layer
    lp = LayerPlacement.balanced(costs, 4)
    assert lp.counts == (1, 3, 3, 1)


@given(st.lists(st.floats(0.1, 10), min_size=1, max_size=12), st.integers(1, 6))
def test_balanced_placement_is_optimal(costs, stages):
    if stages > len(costs):
        return
    lp = LayerPlacement.balanced(costs, stages)
    worst = max(sum(costs[i] for i in lp.layers(s)) for s in range(stages))
    # no single cut can be better than the heaviest layer, nor than the even share
    assert worst >= max(costs) - 1e-9 and worst >= sum(costs) / stages - 1e-9
    # exhaustive check of every split for small inputs
    if len(costs) <= 8:
        from itertools import combinations

        best = min(
            max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
            for cuts in combinations(range(1, len(costs)), stages - 1)
        )
        assert worst == pytest.approx(best)
