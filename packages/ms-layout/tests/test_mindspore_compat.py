"""Conversion to and from mindspore.parallel.Layout, checked against MindSpore itself."""

import numpy as np
import pytest

from ms_layout import Layout, from_mindspore, shard, to_mindspore

pytestmark = pytest.mark.needs_mindspore

CASES = [
    ((2, 2, 2), ("dp", "sp", "mp"), ("mp", ("sp", "dp"))),
    ((2, 2, 2), ("dp", "sp", "mp"), (("dp", "sp"), "None")),
    ((2, 4), ("dp", "tp"), ("None", "tp", "dp")),
    ((8,), ("x",), ("x",)),
]


@pytest.mark.parametrize(("matrix", "names", "specs"), CASES)
def test_same_dict_as_mindspore(matrix, names, specs):
    from mindspore.parallel import Layout as MsLayout

    ours = Layout(matrix, names)(*specs)
    theirs = MsLayout(matrix, names)(*specs)
    assert to_mindspore(ours).to_dict() == theirs.to_dict()
    assert ours.tensor_map == theirs.to_dict()["tensor_map"]
    assert from_mindspore(theirs) == ours


def test_rank_list_round_trip():
    ours = Layout((2, 2), ("dp", "tp"), rank_list=(4, 5, 6, 7))("tp", "None")
    ms_layout = to_mindspore(ours)
    assert ms_layout.to_dict()["rank_list"] == [4, 5, 6, 7]
    assert from_mindspore(ms_layout) == ours


@pytest.mark.parametrize("tensor_map", [(2, 0), (1, -1), (-1, 2), (0, 1)])
def test_shards_match_mindspore_load_tensor(tensor_map):
    # MindSpore's own offline slicer (private, single-axis maps only) is the independent reference.
    import mindspore as ms
    from mindspore.parallel._tensor import _load_tensor

    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    layout = Layout.from_tensor_map((2, 2, 2), tensor_map, ("dp", "sp", "mp"))
    for rank in range(8):
        expected = _load_tensor(ms.Tensor(x), [2, 2, 2], list(tensor_map), rank_id=rank)
        np.testing.assert_array_equal(shard(x, layout, rank), expected)
