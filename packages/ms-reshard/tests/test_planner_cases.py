"""Named cases from docs/rlhf-reshard-prior-art.md §5, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
from strategies import shards_of

from ms_layout import Layout, ParallelConfig, Role, optimizer_layout, weight_layout
from ms_reshard import OpKind, ReshardError, apply_local, plan
from ms_reshard.validate import validate


def _run(src, dst, shape, **kw):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    p = plan(src, dst, shape, **kw)
    out = apply_local(p, shards_of(x, src))
    for r, want in shards_of(x, dst).items():
        np.testing.assert_array_equal(out[r], want)
    validate(p)
    assert (p.received == p.lower_bound).all()
    return p


def kinds(p):
    return sorted(c.kind.value for c in p.collectives)


def test_meshes_that_do_not_factor_2x3_to_3x2():
    # MindSpore's device-matrix unification fails here (prefixes {2,3,6}); boxes do not care.
    p = _run(Layout((2, 3), ("a", "b"))("a", "b"), Layout((3, 2), ("a", "b"))("a", "b"), (6, 6))
    assert p.bytes_moved() == p.lower_bound_total() > 0


def test_mindspore_doc_layout_multi_axis_to_transposed():
    mesh = Layout((2, 2, 2), ("dp", "sp", "mp"))
    _run(mesh("mp", ("sp", "dp")), mesh(("dp", "sp"), "mp"), (8, 8))


def test_identical_layouts_are_local_copies_only():
    lay = Layout((2, 2), ("dp", "tp"))("tp", "None")
    p = _run(lay, lay, (4, 6))
    assert len(p.xfer_src) == 0 and not p.collectives and p.bytes_moved() == 0
    assert len(p.copy_id) == 4


def test_tp_split_rows_to_split_cols_is_one_all_to_all():
    p = _run(Layout((4,), ("tp",))("tp", "None"), Layout((4,), ("tp",))("None", "tp"), (8, 8))
    assert kinds(p) == ["all_to_all"] and len(p.xfer_src) == 0


def test_split_to_replicated_is_all_gather_per_replica_group():
    p = _run(Layout((2, 2), ("dp", "tp"))("tp", "None"), Layout((4,), ("x",))("None", "None"), (8, 4))
    assert kinds(p) == ["all_gather", "all_gather"]
    assert [list(g) for g in p.iter_collective_groups()] == [[0, 1], [2, 3]]


def test_no_collectives_when_disabled():
    p = _run(Layout((4,), ("tp",))("tp", "None"), Layout((4,), ("tp",))("None", "tp"), (8, 8), collectives=False)
    assert not p.collectives and len(p.xfer_src) == 12


def test_optimizer_sharded_dp2_tp2_to_tp4():
    train = ParallelConfig(dp=2, tp=2, optimizer_shard=True)
    infer = ParallelConfig(tp=4)
    for role in (Role.COLUMN, Role.ROW, Role.VOCAB):
        src, dst = optimizer_layout(train, role), weight_layout(infer, role)
        p = _run(src, dst, (16, 8))
        # every rank needs 1/4 of the tensor; what it keeps from its 1/4 training shard it does not receive
        assert p.lower_bound_total() <= 4 * 16 * 8 * 4 * 3 // 4


def test_pipeline_stages_to_tp2_on_two_of_the_ranks():
    train = ParallelConfig(tp=2, pp=2)  # stage 0 = ranks 0,1; stage 1 = ranks 2,3
    infer = ParallelConfig(tp=2)
    for stage in (0, 1):
        src, dst = weight_layout(train, Role.COLUMN, stage=stage), weight_layout(infer, Role.COLUMN)
        p = _run(src, dst, (8, 4))
        if stage == 0:
            assert p.bytes_moved() == 0  # already in place
        else:
            assert sorted({int(p.ranks[i]) for i in p.xfer_src}) == [2, 3]


@pytest.mark.parametrize("dst_ranks", [4, 2])
def test_eight_ranks_to_fewer(dst_ranks):
    src = Layout((2, 4), ("dp", "tp"))("tp", ("dp",))
    dst = Layout((dst_ranks,), ("tp",))("tp", "None")
    p = _run(src, dst, (8, 8))
    assert p.ranks.tolist() == list(range(8))


def test_disjoint_rank_sets_and_expert_dim():
    src = Layout((2, 2), ("ep", "tp"), rank_list=(0, 1, 2, 3))("ep", "tp", "None")
    dst = Layout((4,), ("ep",), rank_list=(10, 11, 12, 13))("ep", "None", "None")
    p = _run(src, dst, (4, 6, 2))
    assert not len(p.copy_id) and p.bytes_moved() == 4 * 6 * 2 * 4


def test_memory_cap_splits_into_rounds():
    src, dst = Layout((4,), ("tp",))("tp", "None"), Layout((4,), ("tp",))("None", "None")
    free = _run(src, dst, (16, 16))
    capped = _run(src, dst, (16, 16), mem_cap=256)
    assert free.rounds == 1 and capped.rounds > 1
    assert capped.bytes_moved() == free.bytes_moved()
    assert any("lowered" in n for n in capped.notes)


def test_scalar_tensor():
    p = _run(Layout((4,), ("tp",))(), Layout((2,), ("tp",), rank_list=(6, 7))(), ())
    assert p.bytes_moved() == 8


def test_zero_sized_dim_plans_nothing():
    p = plan(Layout((2,), ("tp",))("tp", "None"), Layout((2,), ("tp",))("None", "tp"), (0, 4))
    assert p.bytes_moved() == 0 and not len(p.copy_id)


def test_ops_are_ordered_and_printable():
    p = plan(Layout((2,), ("tp",))("tp", "None"), Layout((2,), ("tp",))("None", "tp"), (4, 4), collectives=False)
    ops = p.rank_ops(0)
    assert sorted(o.kind.value for o in ops) == ["copy", "recv", "send"] and ops[0].kind is OpKind.COPY
    assert "r0 send [0:2, 2:4] to 1" in [str(o) for o in ops]
    text = str(p)
    assert "lower bound" in text and "rank 1:" in text


# ---------------------------------------------------------------- bad input


def test_incompatible_shapes_name_the_layout():
    with pytest.raises(ReshardError, match=r"dst layout .* cannot hold global shape \(6, 4\)"):
        plan(Layout((2,), ("tp",))("tp", "None"), Layout((4,), ("tp",))("tp", "None"), (6, 4))
    with pytest.raises(ReshardError, match="has 3 dims"):
        plan(Layout((2,), ("tp",))("tp", "None"), Layout((2,), ("tp",))("tp", "None"), (4, 4, 4))


def test_layout_without_tensor_map_and_bad_numbers():
    with pytest.raises(ReshardError, match="tensor map"):
        plan(Layout((2,), ("tp",)), Layout((2,), ("tp",))("tp"), (4,))
    lay = Layout((2,), ("tp",))("tp")
    with pytest.raises(ReshardError, match="itemsize"):
        plan(lay, lay, (4,), itemsize=0)
    with pytest.raises(ReshardError, match="mem_cap"):
        plan(lay, lay, (4,), itemsize=4, mem_cap=2)


def test_apply_local_rejects_unknown_ranks_shapes_and_missing_shards():
    src, dst = Layout((2,), ("tp",))("tp", "None"), Layout((2,), ("tp",), rank_list=(5, 6))("tp", "None")
    p = plan(src, dst, (4, 4))
    good = {0: np.zeros((2, 4)), 1: np.zeros((2, 4))}
    with pytest.raises(ReshardError, match="rank 7"):
        apply_local(p, {**good, 7: np.zeros((2, 4))})
    with pytest.raises(ReshardError, match=r"rank 1 has shape \(4, 4\).*\(2, 4\)"):
        apply_local(p, {0: good[0], 1: np.zeros((4, 4))})
    with pytest.raises(ReshardError, match=r"ranks \[1\]"):
        apply_local(p, {0: good[0]})
