"""Balanced partitions of weighted items into k sets (multiway number partitioning).

Two places need it: rollout requests spread over the DP inference instances by predicted length
(sampling.py), and packs spread over the DP training ranks by cost (the trainer). Three steps:

1. Karmarkar-Karp's largest differencing method (LDM, the k-way form): every item starts as a
   k-tuple of subset sums; the two tuples with the largest spread are merged largest-with-smallest
   until one is left. With ``equal_size`` the items are first grouped k at a time in sorted order,
   one per subset, so every merge keeps the subset sizes equal (as verl's
   ``get_seqlen_balanced_partitions(equal_size=True)`` does; docs/rlhf-reshard-prior-art.md §4).
2. Longest-processing-time greedy (LPT), which beats LDM on some inputs; the better of the two is kept.
3. Swap refinement: while a swap of two items (or, without equal sizes, a move of one) between the
   heaviest subset and another lowers the heavier of the two, do the best such swap.

So the result is never worse than either LDM or LPT. Everything is deterministic: ties break by
item index, so every rank computes the same partition.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from .errors import RLHFError


def _check(costs: Sequence[float], k: int) -> np.ndarray:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise RLHFError(f"number of parts k={k!r} must be a positive int")
    arr = np.asarray(costs, dtype=np.float64)
    if arr.ndim != 1:
        raise RLHFError(f"costs must be a 1-d sequence, got shape {arr.shape}")
    bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
    if bad.size:
        raise RLHFError(f"cost of item {int(bad[0])} is {arr[bad[0]]!r}; costs must be finite and >= 0")
    return arr


def loads(costs: Sequence[float], parts: Sequence[Sequence[int]]) -> np.ndarray:
    """The total cost of every part."""
    arr = np.asarray(costs, dtype=np.float64)
    return np.array([arr[list(p)].sum() if len(p) else 0.0 for p in parts])


def makespan(costs: Sequence[float], parts: Sequence[Sequence[int]]) -> float:
    """The cost of the heaviest part."""
    return float(loads(costs, parts).max()) if len(parts) else 0.0


def karmarkar_karp(costs: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """k-way largest differencing method; `equal_size` makes part sizes differ by at most one."""
    arr = _check(costs, k)
    n = len(arr)
    order = sorted(range(n), key=lambda i: (-arr[i], i))
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    if equal_size:
        # pad to a multiple of k with zero-cost dummies (index -1), dropped at the end
        padded = order + [-1] * (-n % k)
        groups = [padded[i : i + k] for i in range(0, len(padded), k)]
    else:
        groups = [[i] + [-1] * (k - 1) for i in order]
    for tick, group in enumerate(groups):
        subsets = sorted(((arr[i] if i >= 0 else 0.0, [i] if i >= 0 else []) for i in group), key=_key)
        heapq.heappush(heap, (-(subsets[0][0] - subsets[-1][0]), tick, subsets))
    tick = len(groups)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # largest sums of a with smallest sums of b (a and b are sorted largest first)
        merged = sorted(((sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))), key=_key)
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tick, merged))
        tick += 1
    subsets = heap[0][2] if heap else [(0.0, []) for _ in range(k)]
    return [sorted(items) for _, items in subsets]


def _key(subset: tuple[float, list[int]]) -> tuple[float, int]:
    total, items = subset
    return (-total, min(items) if items else 1 << 62)


def lpt(costs: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Longest processing time first: each item, largest first, to the lightest part with room."""
    arr = _check(costs, k)
    n = len(arr)
    caps = [n // k + (1 if j < n % k else 0) for j in range(k)] if equal_size else [n] * k
    parts: list[list[int]] = [[] for _ in range(k)]
    load = np.zeros(k)
    for i in sorted(range(n), key=lambda i: (-arr[i], i)):
        room = [j for j in range(k) if len(parts[j]) < caps[j]]
        j = min(room, key=lambda j: (load[j], j))
        parts[j].append(i)
        load[j] += arr[i]
    return [sorted(p) for p in parts]


def refine(costs: Sequence[float], parts: Sequence[Sequence[int]], equal_size: bool, max_iter: int = 10_000):
    """Swap (and, without equal sizes, move) items out of the heaviest part while that lowers it."""
    arr = np.asarray(costs, dtype=np.float64)
    parts = [list(p) for p in parts]
    load = loads(arr, parts)
    tol = 1e-12 * max(1.0, float(arr.sum()))
    for _ in range(max_iter):
        m = int(np.argmax(load))
        best = None  # (new pair max, other part, index in m or -1, index in other or -1)
        for o in range(len(parts)):
            if o == m:
                continue
            a = arr[parts[m]]
            if len(a) and len(parts[o]):
                b = arr[parts[o]]
                delta = a[:, None] - b[None, :]  # moving a out, b in
                pair = np.maximum(load[m] - delta, load[o] + delta)
                i, j = np.unravel_index(int(np.argmin(pair)), pair.shape)
                if pair[i, j] < load[m] - tol and (best is None or pair[i, j] < best[0]):
                    best = (pair[i, j], o, int(i), int(j))
            if not equal_size and len(a):
                pair = np.maximum(load[m] - a, load[o] + a)
                i = int(np.argmin(pair))
                if pair[i] < load[m] - tol and (best is None or pair[i] < best[0]):
                    best = (pair[i], o, i, -1)
        if best is None:
            break
        _, o, i, j = best
        item = parts[m].pop(i)
        if j >= 0:
            parts[m].append(parts[o].pop(j))
        parts[o].append(item)
        load = loads(arr, parts)
    return [sorted(p) for p in parts]


def partition(costs: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Split item indices into k parts of balanced total cost: the better of LDM and LPT, refined
    by swaps. `equal_size` keeps the part sizes within one of each other."""
    arr = _check(costs, k)
    candidates = [karmarkar_karp(arr, k, equal_size), lpt(arr, k, equal_size)]
    best = min(candidates, key=lambda p: makespan(arr, p))
    return refine(arr, best, equal_size)


def lower_bound(costs: Sequence[float], k: int) -> float:
    """No partition into k parts has a lighter heaviest part than this."""
    arr = _check(costs, k)
    return max(float(arr.max()) if len(arr) else 0.0, float(arr.sum()) / k)
