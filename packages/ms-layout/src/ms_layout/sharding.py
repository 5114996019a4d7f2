"""Cutting a global numpy array into a rank's shard, and putting shards back together."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .errors import LayoutError
from .layout import Layout


def shard(array: np.ndarray, layout: Layout, rank: int) -> np.ndarray:
    """The shard of `array` that `rank` holds under `layout` (a contiguous copy)."""
    array = np.asarray(array)
    return array[layout.global_slice(array.shape, rank)].copy(order="C")  # keeps 0-d arrays 0-d


def unshard(shards: Mapping[int, np.ndarray], layout: Layout, *, check_replicas: bool = True) -> np.ndarray:
    """Rebuild the global array from {rank: shard}; one holder of each chunk is enough.

    With check_replicas, every given replica of a chunk must equal the others, so a rank that
    drifted is reported instead of silently ignored.
    """
    if not shards:
        raise LayoutError("unshard got no shards")
    for rank in shards:
        layout.position(rank)  # names a rank outside the mesh
    first = np.asarray(next(iter(shards.values())))
    local = first.shape
    if len(local) != layout.ndim:
        raise LayoutError(f"shard shape {local} has {len(local)} dims; the layout maps {layout.ndim}")
    global_shape = tuple(n * parts for n, parts in zip(local, layout.splits))
    out = np.empty(global_shape, dtype=first.dtype)
    for chunk, owners in layout.shard_owners().items():
        held = [r for r in owners if r in shards]
        if not held:
            raise LayoutError(f"no shard given for chunk {chunk}; any of ranks {list(owners)} holds it")
        box = layout.global_slice(global_shape, held[0])
        for rank in held:
            part = np.asarray(shards[rank])
            if part.shape != local:
                raise LayoutError(f"shard of rank {rank} has shape {part.shape}; expected {local}")
            if rank == held[0]:
                out[box] = part
            elif check_replicas and not np.array_equal(part, out[box], equal_nan=part.dtype.kind == "f"):
                raise LayoutError(f"replicas disagree: rank {rank} differs from rank {held[0]} on chunk {chunk}")
    return out
