"""The weight sync's byte accounting: each rank's target shards, bfloat16 included."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.needs_mindspore  # ms_rlhf.runtime loads MindSpore


class _Plan:
    """A plan's per-rank figures, as ms_reshard's ModelPlan reports them."""

    def per_rank(self):
        return {0: {"received": 16, "lower_bound": 8}}


def test_plan_bytes_count_each_ranks_shards_in_their_dtype():
    from ms_layout import Layout
    from ms_reshard import ParamSpec
    from ms_rlhf.runtime.sync import PlanBytes

    tp = Layout((2,), ("tp",))
    targets = {
        "w": ParamSpec(tp("tp", "None"), (4, 6), "bfloat16"),  # numpy has no bfloat16: 2 bytes each
        "b": ParamSpec(tp("None"), (6,), "float32"),  # replicated: whole on both ranks
    }
    got = PlanBytes.of(_Plan(), targets, 0)
    held = 2 * 6 * 2 + 6 * 4  # rank 0's half of w, all of b
    assert got == PlanBytes(received=16, local=held - 16, lower_bound=8)
    assert PlanBytes.of(_Plan(), targets, 1) == PlanBytes(received=0, local=held, lower_bound=0)
