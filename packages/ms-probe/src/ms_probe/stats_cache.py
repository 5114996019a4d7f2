"""Each distinct tensor's statistics computed once: a module's output is the next module's input,
a parent's input its first child's, a gradient passes through several backward items.

Entries are keyed by what the adapter's `storage_key` says identifies a tensor's values: its data
address, shape, strides, dtype and, where the framework keeps one, its version counter (torch's
`_version` counts in-place updates; so does MindSpore's for some in-place ops). An entry holds the
tensor itself, so that its memory cannot be freed and reused by another tensor with the same key
while the entry lives. The cache keeps the last `CACHE_SIZE` tensors (repeats come close together,
and a longer list would keep gradients alive that the backward pass would have freed), and is
emptied at every step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

CACHE_SIZE = 64
"""Tensors remembered at most. On the benchmark model 73 of the 313 tensors of a step are repeats
(4.0M of 21.8M elements), all but one within 40 tensors of their first record. Keyed by address
without holding the tensors, 148 looked like repeats: freed memory is reused at once, and those
other tensors would have been given wrong statistics."""


class StatsCache:
    """The records of recently seen tensors, by storage key, least recently used dropped first."""

    def __init__(self, size: int = CACHE_SIZE):
        self.size = size
        self.hits = 0
        self._entries: OrderedDict[Hashable, tuple[dict[str, Any], Any]] = OrderedDict()

    def get(self, key: Hashable) -> dict[str, Any] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry[0]

    def put(self, key: Hashable, record: dict[str, Any], keep: Any) -> None:
        """Remember `record` for `key`; `keep` (the tensor) stays alive while the entry does."""
        self._entries[key] = (record, keep)
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
        self.hits = 0


__all__ = ["CACHE_SIZE", "StatsCache"]
