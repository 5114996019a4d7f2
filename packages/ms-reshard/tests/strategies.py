"""Hypothesis strategies: random layouts (meshes, multi-axis maps, replicas, rank subsets) and shapes."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from ms_layout import Layout


@st.composite
def layouts(draw, ndim: int, max_rank: int = 12):
    """A layout of `ndim` dims over a random mesh of at most 8 ranks, on random global ranks."""
    naxes = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(1, 3), min_size=naxes, max_size=naxes).filter(lambda s: math.prod(s) <= 8))
    names = tuple(f"a{i}" for i in range(naxes))
    target = [draw(st.integers(-1, ndim - 1)) for _ in names]  # -1: a replica axis
    order = draw(st.permutations(names))  # order of axes inside a multi-axis dim
    dims = [tuple(a for a in order if target[names.index(a)] == d) for d in range(ndim)]
    n = math.prod(sizes)
    kind = draw(st.sampled_from(["default", "shifted", "scattered"]))
    if kind == "default":
        ranks = None
    elif kind == "shifted":
        start = draw(st.integers(0, max_rank - n))
        ranks = tuple(range(start, start + n))
    else:
        ranks = tuple(draw(st.permutations(range(max_rank)))[:n])
    return Layout(tuple(sizes), names, tuple(dims), ranks)


@st.composite
def layout_pairs(draw, max_ndim: int = 3):
    """(src, dst, shape): two independent layouts and a shape both can split evenly."""
    ndim = draw(st.integers(0, max_ndim))
    src, dst = draw(layouts(ndim)), draw(layouts(ndim))
    shape = tuple(math.lcm(a, b) * draw(st.integers(1, 2)) for a, b in zip(src.splits, dst.splits))
    return src, dst, shape


def shards_of(x: np.ndarray, layout: Layout) -> dict[int, np.ndarray]:
    """Each rank's shard by plain slicing (np.array keeps 0-d arrays 0-d)."""
    return {r: np.array(x[layout.global_slice(x.shape, r)]) for r in layout.ranks}


def lower_bound_by_masks(src: Layout, dst: Layout, shape) -> dict[int, int]:
    """Elements of each target shard its rank does not hold, by painting boolean masks."""
    out = {}
    for r in dst.ranks:
        want = np.zeros(shape, dtype=bool)
        want[dst.global_slice(shape, r)] = True
        if r in src.ranks:
            want[src.global_slice(shape, r)] = False
        out[r] = int(want.sum())
    return out
