"""Replacing groups of point-to-point transfers by one collective that moves the same bytes.

A set of k ranks whose transfers among themselves form a complete exchange -- every ordered pair
(i, j), i != j, has exactly one transfer, all of the same size, and no transfer leaves or enters
the set -- is exactly what a collective does:

* if each member sends the same box to every other member, it is an all-gather of those boxes;
* otherwise it is an all-to-all (MindSpore's AllToAll, DTensor's Shard(a) -> Shard(b)).

Both move k-1 pieces into and out of every member, the same bytes as the transfers they replace,
and on accelerators one collective beats k(k-1) messages. Anything else stays point-to-point.
"""

from __future__ import annotations

import numpy as np

from .plan import Collective, OpKind, box_elems


def components(sender: np.ndarray, recv: np.ndarray, n_ids: int) -> np.ndarray:
    """Connected-component label (the smallest id in it) of every id, over the transfer edges."""
    label = np.arange(n_ids, dtype=np.int64)
    while True:
        low = np.minimum(label[sender], label[recv])
        new = label.copy()
        np.minimum.at(new, sender, low)
        np.minimum.at(new, recv, low)
        new = new[new]  # pointer jumping: converges in O(log diameter) passes
        if np.array_equal(new, label):
            return label
        label = new


def find_collectives(
    sender: np.ndarray, recv: np.ndarray, boxes: np.ndarray, n_ids: int, elems: np.ndarray | None = None
) -> list[tuple[Collective, np.ndarray]]:
    """Collectives found among the transfers, each with the transfer rows it replaces."""
    if len(sender) == 0:
        return []
    # Members of a complete exchange send as many transfers as they receive: transfers touching
    # any other id cannot be in a collective, which usually rules out everything at once.
    out_deg = np.bincount(sender, minlength=n_ids)
    in_deg = np.bincount(recv, minlength=n_ids)
    candidate = (out_deg == in_deg) & (out_deg > 0)
    keep = candidate[sender] & candidate[recv]
    if not keep.any():
        return []
    rows_all = np.flatnonzero(keep)
    sender, recv, boxes = sender[keep], recv[keep], boxes[keep]
    elems = None if elems is None else elems[keep]
    label = components(sender, recv, n_ids)
    comp = label[sender]
    involved = np.zeros(n_ids, dtype=bool)
    involved[sender] = involved[recv] = True
    size = np.bincount(label[involved], minlength=n_ids)
    n_xfer = np.bincount(comp, minlength=n_ids)
    # ... and every transfer of each member stays inside the component
    total_out = np.bincount(label[involved], weights=out_deg[involved], minlength=n_ids).astype(np.int64)
    ok = (size >= 2) & (n_xfer == size * (size - 1)) & (total_out == n_xfer)
    if not ok.any():
        return []
    elems = box_elems(boxes) if elems is None else elems
    lo = np.full(n_ids, np.iinfo(np.int64).max)
    hi = np.zeros(n_ids, dtype=np.int64)
    np.minimum.at(lo, comp, elems)
    np.maximum.at(hi, comp, elems)
    ok &= lo == hi
    # a complete exchange has each ordered pair once: count distinct pairs in the candidate components
    cand = ok[comp]
    pairs = np.unique(sender[cand] * n_ids + recv[cand])
    n_pairs = np.bincount(label[pairs // n_ids], minlength=n_ids)
    ok &= n_pairs == n_xfer
    out = []
    order = np.argsort(comp, kind="stable")
    bounds = np.searchsorted(comp[order], np.flatnonzero(ok))
    for c, start in zip(np.flatnonzero(ok), bounds):
        rows = order[start : start + n_xfer[c]]
        out.append((_collective(sender[rows], recv[rows], boxes[rows], int(hi[c])), rows_all[rows]))
    return out


def _collective(sender: np.ndarray, recv: np.ndarray, boxes: np.ndarray, elems: int) -> Collective:
    members = tuple(int(m) for m in np.unique(sender))
    k, ndim = len(members), boxes.shape[1]
    index = {m: i for i, m in enumerate(members)}
    matrix = np.zeros((k, k, ndim, 2), dtype=np.int64)
    for s, r, box in zip(sender, recv, boxes):
        matrix[index[int(s)], index[int(r)]] = box
    off_diag = ~np.eye(k, dtype=bool)
    # all-gather: member i sends one box to everyone; compare each row against its first off-diagonal box
    first = matrix[np.arange(k), (np.arange(k) + 1) % k]
    same = (matrix == first[:, None]).all(axis=(2, 3))
    if same[off_diag].all():
        return Collective(OpKind.ALL_GATHER, members, first, elems)
    return Collective(OpKind.ALL_TO_ALL, members, matrix, elems)
