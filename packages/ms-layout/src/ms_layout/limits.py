"""Limits on sizes that come from input (rank counts, shapes, message and file sizes).

Every limit has a default and an environment variable that raises it; a value over it is an error
that names the value, the limit and the variable. ``docs/reliability.md`` lists them all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Limit:
    """One bound on an input size, raisable through an environment variable."""

    env: str
    """Environment variable that overrides the default (an integer)."""
    default: int
    """The bound when the variable is unset."""
    what: str
    """What is counted, for the error message."""

    @property
    def value(self) -> int:
        """The bound in force now (the variable is read on every use)."""
        raw = os.environ.get(self.env)
        if raw is None or raw == "":
            return self.default
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{self.env}={raw!r} is not an integer") from None

    def check(self, value: int, name: str | None = None, error: type[Exception] = ValueError) -> int:
        """Return `value`, or raise `error` if it is over the bound."""
        bound = self.value
        if value > bound:
            label = name or self.what
            raise error(f"{label} = {value} is over the limit of {bound} {self.what} (raise it with {self.env}=N)")
        return value
