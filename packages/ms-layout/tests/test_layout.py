"""Layout: MindSpore's rank assignment, rank math, and the errors that name the bad value."""

import numpy as np
import pytest

from ms_layout import Layout, LayoutError, shard, unshard


def test_mindspore_docs_example_rank_order():
    # mindspore.parallel.Layout docs: column chunks 0..3 of the first row block on ranks 0, 4, 2, 6.
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))("mp", ("sp", "dp"))
    owners = [[r for r in layout.ranks if layout.chunk_index(r) == (0, c)] for c in range(4)]
    assert owners == [[0], [4], [2], [6]]
    assert layout.tensor_map == (0, (1, 2))
    assert layout.shard_shape((8, 16)) == (4, 4)
    assert layout.global_slice((8, 16), 6) == (slice(0, 4), slice(12, 16))


def test_none_and_replicas():
    layout = Layout((2, 4), ("dp", "tp"))("None", "tp")
    assert layout.tensor_map == (-1, 0)
    assert layout.replica_axes == ("dp",)
    assert layout.replica_count == 2
    assert layout.replicas(1) == (1, 5)
    assert layout.shard_owners()[(0, 1)] == (1, 5)


def test_coords_and_axis_groups_row_major():
    layout = Layout((2, 3), ("a", "b"))("a", "b")
    assert layout.coords(4) == {"a": 1, "b": 1}
    assert layout.axis_group("a", 4) == (1, 4)
    assert layout.axis_groups("b") == [(0, 1, 2), (3, 4, 5)]
    assert layout.axis_group(("a", "b"), 0) == tuple(range(6))


def test_rank_list_maps_positions_to_global_ranks():
    layout = Layout((2,), ("tp",), rank_list=(4, 5))("tp", "None")
    assert layout.ranks == (4, 5)
    assert layout.global_slice((4, 2), 5) == (slice(2, 4), slice(0, 2))
    with pytest.raises(LayoutError, match="rank 0 is not in this layout's rank_list"):
        layout.coords(0)


def test_shard_unshard_uneven_and_missing():
    layout = Layout((2, 2), ("dp", "tp"))("tp", "None")
    x = np.arange(12.0).reshape(4, 3)
    shards = {r: shard(x, layout, r) for r in layout.ranks}
    np.testing.assert_array_equal(unshard(shards, layout), x)
    np.testing.assert_array_equal(unshard({0: shards[0], 3: shards[3]}, layout), x)
    with pytest.raises(LayoutError, match=r"chunk \(1, 0\)"):
        unshard({0: shards[0], 2: shards[2]}, layout)
    bad = dict(shards)
    bad[2] = bad[2] + 1
    with pytest.raises(LayoutError, match="rank 2 differs from rank 0"):
        unshard(bad, layout)
    with pytest.raises(LayoutError, match=r"size 5, not divisible into 2"):
        shard(np.zeros((5, 3)), layout, 0)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Layout((2, 2), ("dp", "tp"))("xx", "None"), "unknown alias 'xx'"),
        (lambda: Layout((2, 2), ("dp", "tp"))("dp", ("tp", "dp")), "alias 'dp' is used on two tensor dims"),
        (lambda: Layout((2, 0), ("dp", "tp")), "has size 0"),
        (lambda: Layout((2, -1), ("dp", "tp")), "has size -1"),
        (lambda: Layout((2, 2), ("dp", "dp")), "repeats a name"),
        (lambda: Layout((2, 2), ("dp",)), "has 1 names for device_matrix"),
        (lambda: Layout((2, 2), ("dp", "tp"), rank_list=(0, 1, 2)), "must hold 4 distinct"),
        (lambda: Layout((2, 2), ("dp", "tp"))("dp").shard_shape((3,)), "size 3, not divisible"),
        (lambda: Layout((2, 2), ("dp", "tp"))("dp").shard_shape((4, 4)), "has 2 dims; the layout maps 1"),
        (lambda: Layout((2, 2), ("dp", "tp")).splits, "has no tensor map yet"),
        (lambda: Layout((2, 2), ("dp", "tp"))("dp").coords(4), "rank 4 is not in this mesh"),
        (lambda: Layout.from_tensor_map((2, 2), (3,)), "tensor_map entry 3"),
    ],
)
def test_bad_input_names_the_value(build, message):
    with pytest.raises(LayoutError, match=message) as info:
        build()
    assert isinstance(info.value, ValueError)


def test_from_tensor_map_round_trip():
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))(("dp", "sp"), "None", "mp")
    again = Layout.from_tensor_map(layout.device_matrix, layout.tensor_map, layout.alias_names)
    assert again == layout
    assert Layout.from_dict(layout.to_dict()) == layout


def test_scalar_shard_stays_scalar():
    layout = Layout((2,), ("dp",))()
    x = np.array(3.0)
    assert shard(x, layout, 1).shape == ()
    assert unshard({0: shard(x, layout, 0)}, layout) == x


@pytest.mark.parametrize("rank_list", [None, (9, 3, 7, 1, 5, 11, 0, 2, 4, 6, 8, 10)])
def test_ranks_where_is_the_slice_of_ranks_at_one_coordinate(rank_list):
    mesh = Layout((2, 3, 2), ("dp", "pp", "tp"), rank_list=rank_list)
    for alias, size in zip(mesh.alias_names, mesh.device_matrix):
        for coord in range(size):
            want = tuple(r for r in mesh.ranks if mesh.coords(r)[alias] == coord)  # position order
            assert mesh.ranks_where(alias, coord) == want
    with pytest.raises(LayoutError, match="pp=3"):
        mesh.ranks_where("pp", 3)
    with pytest.raises(LayoutError, match="'ep'"):
        mesh.ranks_where("ep", 0)
