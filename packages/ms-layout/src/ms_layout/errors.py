"""The exceptions of ms-layout: one for bad input, one for communication failures."""

from __future__ import annotations


class LayoutError(ValueError):
    """Bad input to a layout, a parallel config or a serialized blob; the message names the value."""


class CommError(RuntimeError):
    """A process-group operation that failed, timed out or is not supported by the backend."""


class RankFailedError(CommError):
    """A rank of a local multi-process run raised or exited; carries the rank and its traceback."""

    def __init__(self, rank: int, detail: str):
        self.rank = rank
        self.detail = detail
        super().__init__(f"rank {rank} failed:\n{detail}")
