"""Bounds on the sizes ms-reshard reads from its input (manifests, plans, layouts, the command line).

Each is an ``ms_layout.limits.Limit``: a default that covers real models, raised with its
environment variable. They are checked before anything of that size is built or allocated, so a
manifest claiming a 1 EiB tensor or a layout over a billion ranks is an error naming the value.
"""

from __future__ import annotations

import math
from typing import Any

from ms_layout import Layout
from ms_layout.limits import Limit

from .errors import ReshardError

MAX_RANKS = Limit("MS_RESHARD_MAX_RANKS", 1 << 16, "ranks")
"""Ranks of one layout or config, and the highest rank number (the planner's arrays are per rank)."""
MAX_TENSOR_BYTES = Limit("MS_RESHARD_MAX_TENSOR_BYTES", 1 << 40, "bytes of one tensor")
"""Bytes of one global tensor (a target shard of it is allocated when a checkpoint is resharded)."""
MAX_NDIM = Limit("MS_RESHARD_MAX_NDIM", 32, "tensor dims")
"""Dims of one tensor (numpy 1.x's own bound; the plans hold [pieces, ndim, 2] boxes)."""
MAX_LAYERS = Limit("MS_RESHARD_MAX_LAYERS", 1 << 16, "decoder layers")
"""Decoder layers of a model (the pipeline stage table has one entry per layer)."""
MAX_MANIFEST_BYTES = Limit("MS_RESHARD_MAX_MANIFEST_BYTES", 1 << 30, "bytes of manifest.json")
"""Bytes of a checkpoint manifest, read whole (it lists every tensor of every rank)."""
MAX_SPEC_FILE_BYTES = Limit("MS_RESHARD_MAX_SPEC_FILE_BYTES", 16 << 20, "bytes of a layout, config or fusion file")
"""Bytes of a layout, ParallelConfig or fusion-rule file named on the command line."""


def is_int(value: Any) -> bool:
    """A real int (bool excluded: JSON's true is not a size)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_count(value: int, limit: Limit, name: str) -> int:
    """`value` if it is within `limit`; a ReshardError naming `name` otherwise."""
    return limit.check(value, name, error=ReshardError)


def check_shape(shape: Any, itemsize: int, what: str) -> tuple[int, ...]:
    """A global shape as a tuple: a list of non-negative ints, within MAX_NDIM and MAX_TENSOR_BYTES."""
    if not isinstance(shape, (list, tuple)) or not all(is_int(n) and n >= 0 for n in shape):
        raise ReshardError(f"{what} = {short_repr(shape)} must be a list of non-negative ints")
    check_count(len(shape), MAX_NDIM, f"dims of {what}")
    check_count(math.prod(shape) * itemsize, MAX_TENSOR_BYTES, f"bytes of {what} {list(shape)}")
    return tuple(shape)


def check_layout(layout: Layout, what: str) -> Layout:
    """`layout` if its rank count and rank numbers are within MAX_RANKS."""
    check_count(layout.rank_count, MAX_RANKS, f"ranks of {what}")
    if layout.rank_list is not None and layout.rank_list:
        check_count(max(layout.rank_list), MAX_RANKS, f"highest rank of {what}")
    return layout


def check_mesh_data(data: Any, what: str) -> None:
    """Refuse a layout dict whose device matrix multiplies out over MAX_RANKS before it is built."""
    sizes = data.get("device_matrix") if isinstance(data, dict) else None
    if isinstance(sizes, (list, tuple)) and sizes and all(is_int(s) and s > 0 for s in sizes):
        check_count(math.prod(sizes), MAX_RANKS, f"ranks of {what}")


def short_repr(value: Any, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
