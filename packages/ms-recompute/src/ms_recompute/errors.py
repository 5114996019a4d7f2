"""The one exception type of ms-recompute."""

from __future__ import annotations


class RecomputeError(ValueError):
    """Bad input to a recompute plan, the planner or the runtime; the message names the bad value."""
