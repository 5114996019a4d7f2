"""The package's exception types."""

from __future__ import annotations


class RLHFError(ValueError):
    """Bad input to ms-rlhf (a config, a request list, a checkpoint); the message names the value."""


class PackingError(RLHFError):
    """A sample cannot be packed (longer than max_pack_len, or a bad length)."""


class CheckpointError(RLHFError):
    """A checkpoint is missing, incomplete, or its checksums do not match."""
