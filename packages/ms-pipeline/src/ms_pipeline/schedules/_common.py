"""Argument checks shared by the builders."""

from __future__ import annotations

from ..errors import ScheduleError


def check_sizes(name: str, num_ranks: int, num_microbatches: int) -> None:
    """Every builder needs at least one rank and one microbatch, given as ints."""
    for what, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}: {what} must be an int >= 1, got {value!r}")
