"""Conversion between ms_layout.Layout and mindspore.parallel.Layout (needs MindSpore)."""

from __future__ import annotations

from typing import Any

from .errors import LayoutError
from .layout import Layout


def to_mindspore(layout: Layout) -> Any:
    """The equivalent mindspore.parallel.Layout, called with the same per-dim specs."""
    from mindspore.parallel import Layout as MsLayout

    rank_list = None if layout.rank_list is None else list(layout.rank_list)
    ms_layout = MsLayout(tuple(layout.device_matrix), tuple(layout.alias_names), rank_list)
    return ms_layout if layout.dims is None else ms_layout(*layout.spec())


def from_mindspore(ms_layout: Any) -> Layout:
    """Read a mindspore.parallel.Layout (with or without a tensor map) into a Layout."""
    try:
        device_matrix = tuple(ms_layout._device_shape)
        alias_names = tuple(ms_layout._alias_name)
        tensor_map = ms_layout._tensor_map
        rank_list = tuple(ms_layout._rank_list)
    except AttributeError as exc:
        raise LayoutError(f"{type(ms_layout).__name__} is not a mindspore.parallel.Layout: {exc}") from None
    default_ranks = rank_list == tuple(range(len(rank_list)))
    ranks = None if default_ranks else rank_list
    if tensor_map is None:
        return Layout(device_matrix, alias_names, None, ranks)
    return Layout.from_tensor_map(device_matrix, tensor_map, alias_names, ranks)
