"""Schedule builders: pure functions from (ranks, microbatches) to a :class:`~ms_pipeline.ir.Schedule`."""

from __future__ import annotations

from typing import Callable

from ..errors import ScheduleError
from ..ir import Schedule
from .gpipe import gpipe
from .interleaved import interleaved_1f1b
from .one_f_one_b import one_f_one_b
from .zero_bubble_h1 import zero_bubble_h1
from .zero_bubble_v import zero_bubble_v
from .zero_bubble_v_adaptive import zero_bubble_v_adaptive

#: CLI name -> builder(num_ranks, num_microbatches, **options)
BUILDERS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zbh1": zero_bubble_h1,
    "zbv": zero_bubble_v,
    "zbv-adaptive": zero_bubble_v_adaptive,
}


def build(name: str, num_ranks: int, num_microbatches: int, **options) -> Schedule:
    """Build the schedule called ``name`` (one of :data:`BUILDERS`)."""
    try:
        builder = BUILDERS[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(BUILDERS)}") from None
    return builder(num_ranks, num_microbatches, **options)


__all__ = [
    "BUILDERS",
    "build",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "zero_bubble_h1",
    "zero_bubble_v",
    "zero_bubble_v_adaptive",
]
