"""Samples into a *given* number of packs, for when the sample-count cap binds.

First-fit and best-fit decreasing open a pack only when no open one takes the next sample, which
is right when tokens are the scarce resource. When `max_pack_count` binds (short samples, a small
count cap), they fill the first packs' sample slots with the longest samples and leave packs that
run out of slots before tokens: up to 28 % more packs than ceil(n / max_pack_count) on lognormal
lengths. Here the number of packs m is fixed first and every sample is placed among those m:

* worst fit decreasing: each sample, longest first, into the pack with the fewest tokens that still
  has a sample slot and room (keeps the token loads level, so the last, short samples find room in
  whichever packs still have slots);
* best fit decreasing, as the alternative when tokens are tight too;
* a repair when a sample fits nowhere: move one sample j out of a pack b into another pack with a
  slot and room for it, if b then takes the sample.

`fit_into(lengths, cap, count, m)` returns the packs, or None when neither order finds a fit; the
caller tries m = lower bound, bound + 1, ... below what the greedy packers found.
"""

from __future__ import annotations

import numpy as np

HOW = ("worst", "budget", "best")
"""The placement orders tried, in turn."""


class _Bins:
    """m packs being filled: token loads, sample counts, and the pack of every placed sample."""

    def __init__(self, sizes: np.ndarray, cap: int, count: int, m: int):
        self.sizes, self.cap, self.count = sizes, cap, count
        self.loads = np.zeros(m, np.int64)
        self.counts = np.zeros(m, np.int64)
        self.where = np.full(sizes.size, -1, np.int64)

    def put(self, i: int, b: int) -> None:
        self.where[i] = b
        self.loads[b] += self.sizes[i]
        self.counts[b] += 1

    def repair(self, size: int) -> int | None:
        """A pack that takes a sample of `size` once one of its samples j moves to another pack
        with a free slot and room for j; the move is made and the pack returned."""
        placed = np.flatnonzero(self.where >= 0)
        if placed.size == 0:
            return None
        s, b = self.sizes[placed], self.where[placed]
        room = np.where(self.counts < self.count, self.cap - self.loads, -1)  # room of packs with a slot
        first = int(np.argmax(room))
        second = np.max(np.delete(room, first)) if room.size > 1 else -1
        other_room = np.where(b == first, second, room[first])  # the roomiest pack other than j's own
        ok = (self.loads[b] - s + size <= self.cap) & (other_room >= s)
        if not ok.any():
            return None
        j = int(placed[np.argmax(ok)])
        src = int(self.where[j])
        fits = (room >= self.sizes[j]) & (np.arange(room.size) != src)
        dst = int(np.argmax(np.where(fits, room, -1)))
        self.loads[src] -= self.sizes[j]
        self.counts[src] -= 1
        self.put(j, dst)
        return src


def _place(order: list[int], sizes: np.ndarray, cap: int, count: int, m: int, how: str) -> np.ndarray | None:
    bins = _Bins(sizes, cap, count, m)
    index = np.arange(m)
    for i in order:
        size = int(sizes[i])
        fits = (bins.counts < count) & (bins.loads + size <= cap)
        if fits.any():
            if how == "worst":
                key = bins.loads
            elif how == "best":
                key = -bins.loads
            else:  # "budget": the pack whose free tokens per free slot are closest to this sample
                key = np.abs((cap - bins.loads) / np.maximum(count - bins.counts, 1) - size)
            b = int(index[fits][np.argmin(key[fits])])
        else:
            b = bins.repair(size)
            if b is None or bins.counts[b] >= count:
                return None
        bins.put(i, b)
    return bins.where


def fit_into(lengths, cap: int, count: int, m: int) -> list[list[int]] | None:
    """`lengths` placed into exactly m packs of <= cap tokens and <= count samples (empty packs
    dropped), or None if no placement order, with repair, finds one."""
    sizes = np.asarray(lengths, np.int64)
    if m * count < sizes.size or m * cap < int(sizes.sum()):
        return None
    order = sorted(range(sizes.size), key=lambda i: (-int(sizes[i]), i))
    for how in HOW:
        where = _place(order, sizes, cap, count, m, how)
        if where is not None:
            packs = [np.flatnonzero(where == b).tolist() for b in range(m)]
            return [p for p in packs if p]
    return None


__all__ = ["fit_into"]
