"""The exception of ms-pipeline: bad schedules, bad placements, bad cost models."""

from __future__ import annotations


class ScheduleError(ValueError):
    """A schedule, placement or cost model that is malformed; the message names the bad value
    (for a schedule: the broken action, its rank and step, and a step x rank grid)."""
