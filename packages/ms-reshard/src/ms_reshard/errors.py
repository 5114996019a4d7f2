"""The one exception of ms-reshard."""

from __future__ import annotations


class ReshardError(ValueError):
    """Bad input to a planner, an executor or a checkpoint tool; the message names the bad value."""
