"""The package's one exception type."""

from __future__ import annotations


class ModelError(ValueError):
    """A bad config, checkpoint or input to an ms_models model; the message names the bad value."""
