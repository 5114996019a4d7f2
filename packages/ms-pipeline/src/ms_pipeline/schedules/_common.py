"""Argument checks shared by the builders."""

from __future__ import annotations

from ..errors import ScheduleError
from ..ir import check_schedule_size


def check_sizes(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> None:
    """Every builder needs at least one rank and one microbatch, given as ints, and no more
    stage x microbatch pairs than MS_PIPELINE_MAX_SCHEDULE_SIZE (checked before building)."""
    for what, value in (
        ("num_ranks", num_ranks),
        ("num_microbatches", num_microbatches),
        ("stages_per_rank", stages_per_rank),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}: {what} must be an int >= 1, got {value!r:.50}")
    per_rank = f" ({num_ranks} ranks x {stages_per_rank})" if stages_per_rank > 1 else ""
    check_schedule_size(num_ranks * stages_per_rank, num_microbatches, f"{name}{per_rank}")
