"""Property tests: unshard(shard(x)) is x, and each element has exactly replica_count owners."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_layout import Layout, shard, unshard


@st.composite
def layouts_and_shapes(draw):
    axes = draw(st.integers(1, 4))
    sizes = tuple(draw(st.lists(st.integers(1, 3), min_size=axes, max_size=axes)))
    names = tuple(f"a{i}" for i in range(axes))
    ndim = draw(st.integers(1, 3))
    order = draw(st.permutations(names))
    cuts = sorted(draw(st.lists(st.integers(0, axes), min_size=ndim - 1, max_size=ndim - 1)))
    used = draw(st.integers(0, axes))  # axes past `used` stay unsplit (replicas)
    dims, start = [], 0
    for end in cuts + [axes]:
        dims.append(tuple(a for a in order[start:end] if order.index(a) < used))
        start = end
    specs = [d if d else "None" for d in dims]
    layout = Layout(sizes, names)(*specs)
    shape = tuple(p * draw(st.integers(1, 3)) for p in layout.splits)
    return layout, shape


@settings(max_examples=200, deadline=None)
@given(layouts_and_shapes())
def test_unshard_of_shard_is_identity(case):
    layout, shape = case
    x = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    shards = {r: shard(x, layout, r) for r in layout.ranks}
    assert all(s.shape == layout.shard_shape(shape) for s in shards.values())
    np.testing.assert_array_equal(unshard(shards, layout), x)


@settings(max_examples=200, deadline=None)
@given(layouts_and_shapes())
def test_every_element_owned_by_replica_count_ranks(case):
    layout, shape = case
    owners = np.zeros(shape, dtype=np.int64)
    for _, box in layout.iter_shards(shape):
        owners[box] += 1
    assert (owners == layout.replica_count).all()
    assert layout.replica_count * math.prod(layout.splits) == layout.rank_count
