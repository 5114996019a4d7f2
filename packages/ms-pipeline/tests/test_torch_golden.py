"""Golden test: ms-pipeline's ZeroBubbleV runs, on every rank, the same computations in the same
order as PyTorch's own `torch.distributed.pipelining.ScheduleZBVZeroBubble` (its per-rank order,
read through ms-pipeline's PyTorch CSV dialect: I = dx, W = dW)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import ms_pipeline as mp

pytestmark = pytest.mark.needs_torch


def torch_zbv_order(p: int, m: int) -> mp.Schedule:
    """PyTorch's ZBV pipeline_order for p ranks and m microbatches, as a Schedule. Its
    `_calculate_single_rank_operations` reads only the sizes, so no process group is needed."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    sizes = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    rows = [
        ",".join("" if a is None else str(a) for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(sizes, r))
        for r in range(p)
    ]
    return mp.from_csv("\n".join(rows) + "\n", dialect="torch", num_microbatches=m)


@pytest.mark.parametrize(("p", "m"), [(2, 3), (2, 4), (2, 8), (3, 5), (3, 9), (4, 7), (4, 8), (4, 12)])
def test_zbv_order_per_rank_equals_pytorchs(p, m):
    theirs, ours = torch_zbv_order(p, m), mp.zero_bubble_v(p, m)
    assert theirs.stage_to_rank == ours.stage_to_rank  # the V: stage s and 2p-1-s on rank s
    for rank in range(p):
        expected = mp.format_actions(theirs.actions[rank])
        assert mp.format_actions([a for a in ours.actions[rank] if a.is_compute]) == expected, rank
    mp.validate(theirs)  # PyTorch's order is a valid schedule by ms-pipeline's own checks
