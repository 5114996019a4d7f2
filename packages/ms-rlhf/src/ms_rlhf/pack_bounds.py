"""Lower bounds on the number of packs, and the checks of a packing request's arguments.

Bin packing with a cardinality constraint: at most `max_pack_len` tokens and `max_pack_count`
samples a pack. No packing uses fewer packs than the largest of ceil(tokens / max_pack_len),
ceil(n / max_pack_count), Martello and Toth's L2 bound and the cardinality bound `count_bound`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import PackingError


def _check(lengths: Sequence[int], max_pack_len: int, max_pack_count: int | None) -> tuple[np.ndarray, int]:
    if isinstance(max_pack_len, bool) or not isinstance(max_pack_len, (int, np.integer)) or max_pack_len < 1:
        raise PackingError(f"max_pack_len={max_pack_len!r} must be a positive int")
    count = len(lengths) if max_pack_count is None else max_pack_count
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise PackingError(f"max_pack_count={max_pack_count!r} must be a positive int (or None: no limit)")
    arr = np.asarray(lengths)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise PackingError(f"lengths must be a 1-d sequence of ints, got {np.asarray(lengths).dtype} {arr.shape}")
    arr = arr.astype(np.int64)
    for i in np.flatnonzero(arr < 1):
        raise PackingError(f"sample {int(i)} has length {int(arr[i])}; lengths must be >= 1")
    for i in np.flatnonzero(arr > max_pack_len):
        raise PackingError(
            f"sample {int(i)} has {int(arr[i])} tokens, more than max_pack_len={max_pack_len}; "
            f"samples are never truncated: raise max_pack_len or drop the sample"
        )
    return arr, max(int(count), 1)


def token_bound(lengths: Sequence[int], max_pack_len: int) -> int:
    """ceil(total tokens / max_pack_len): the bound the issue names."""
    return -(-int(np.sum(lengths)) // max_pack_len) if len(lengths) else 0


def lower_bound(lengths: Sequence[int], max_pack_len: int, max_pack_count: int | None = None) -> int:
    """A lower bound on the number of packs: the largest of Martello-Toth L2, ceil(n / max_pack_count)
    and the cardinality bound of :func:`count_bound`."""
    arr, count = _check(lengths, max_pack_len, max_pack_count)
    if arr.size == 0:
        return 0
    cap = max_pack_len
    best = max(token_bound(arr, cap), -(-arr.size // count), count_bound(arr, cap, count))
    # L2: for alpha <= cap/2, items > cap - alpha each need a bin; items in (cap/2, cap - alpha]
    # too, and the items in [alpha, cap/2] must fit in those bins' free room or in new bins.
    for alpha in np.unique(np.concatenate([[0], arr[arr <= cap // 2]])):
        j1 = arr[arr > cap - alpha]
        j2 = arr[(arr > cap / 2) & (arr <= cap - alpha)]
        j3 = arr[(arr >= alpha) & (arr <= cap / 2)]
        spill = int(j3.sum()) - (j2.size * cap - int(j2.sum()))
        best = max(best, j1.size + j2.size + max(0, -(-spill // cap)))
    return int(best)


def count_bound(arr: np.ndarray, cap: int, count: int) -> int:
    """The bound when both caps bind: every sample longer than cap/2 needs a pack of its own, which
    can take at most count - 1 others, and no more of them than the shortest samples that fit in
    its free tokens; the samples no such pack can take need ceil(rest / count) packs more (and their
    tokens, at least those of the shortest `rest`, ceil(tokens / cap))."""
    arr = np.sort(np.asarray(arr, np.int64))
    big, small = arr[arr > cap / 2], arr[arr <= cap / 2]
    prefix = np.concatenate([[0], np.cumsum(small)])
    fit = np.searchsorted(prefix, cap - big, side="right") - 1  # shortest samples fitting beside each
    rest = max(0, small.size - int(np.minimum(fit, count - 1).sum()))
    return int(big.size + max(-(-rest // count), -(-int(prefix[rest]) // cap)))


__all__ = ["count_bound", "lower_bound", "token_bound"]
