"""Multicast rows: one box sent by one rank to a block of the ranks that hold one target chunk.

A target layout that replicates (a serving layout keeps dense weights whole, or split only over
tp, on every dp replica) makes the point-to-point plan one transfer per (receiver, piece): at 4096
ranks about a million rows for one tensor, which is most of the planning time and memory of a
whole-model plan (docs/ms-reshard.md, "Planning at scale"). Every replica of a target chunk needs
the same pieces, so a multicast plan stores one row per (piece, sender) and leaves the receivers
implicit: row i sends ``box[i]`` from ``src[i]`` to the replicas of target chunk
``target_chunk[i]`` (ids ascending) at positions ``[lo[i], hi[i])``, skipping those that hold the
piece's source chunk ``source_chunk[i]`` themselves (they copy it locally). The rows' size is
(pieces x senders), independent of the number of replicas.

Receivers still receive exactly their lower bound; only the op lists of the ranks (``rank_ops``)
spell the row out, as one send per receiver on the sender and one receive on each receiver, so
the executors and readers of point-to-point plans run multicast plans unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Multicast:
    """The multicast rows of a plan (all in round 0: plans with a memory cap use no multicasts)."""

    src: np.ndarray
    """Per row: id of the sender (a holder of the source chunk)."""
    box: np.ndarray
    """Per row: the global box sent, [m, ndim, 2]."""
    target_chunk: np.ndarray
    """Per row: flat index of the target chunk whose replicas receive the box."""
    source_chunk: np.ndarray
    """Per row: flat index of the source chunk the box lies in (its holders copy it, not receive)."""
    lo: np.ndarray
    """Per row: first position, among the replicas of the target chunk (ids ascending), it goes to."""
    hi: np.ndarray
    """Per row: one past the last position it goes to."""
    dst_chunk: np.ndarray
    """Per id: the flat target chunk it holds (-1: not a target rank)."""
    src_chunk: np.ndarray
    """Per id: the flat source chunk it holds (-1: not a source rank)."""

    def __len__(self) -> int:
        return len(self.src)

    def replicas(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids of target ranks sorted by (chunk, id), start of each chunk's block in them)."""
        ids = np.flatnonzero(self.dst_chunk >= 0)
        ids = ids[np.argsort(self.dst_chunk[ids], kind="stable")]
        n_chunks = int(self.dst_chunk.max(initial=-1)) + 1
        counts = np.bincount(self.dst_chunk[ids], minlength=n_chunks)
        return ids, np.concatenate([[0], np.cumsum(counts)])

    def width(self) -> int:
        """Most replicas of one target chunk: transfer indices are row * width + position."""
        _, start = self.replicas()
        return int(np.diff(start).max(initial=0))

    def expand(self, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Point-to-point form of `rows` (default: all): (row, receiver id, position) per transfer,
        rows in order and each row's receivers in position order (the order the op lists use)."""
        rows = np.arange(len(self.src)) if rows is None else rows
        ids, start = self.replicas()
        n = self.hi[rows] - self.lo[rows]
        row = np.repeat(rows, n)
        pos = self.lo[row] + np.arange(len(row)) - np.repeat(np.cumsum(n) - n, n)
        recv = ids[start[self.target_chunk[row]] + pos]
        keep = self.src_chunk[recv] != self.source_chunk[row]
        return row[keep], recv[keep], pos[keep]

    def received_rows(self, me: int) -> tuple[np.ndarray, int]:
        """(rows id `me` receives, ascending; its position among its target chunk's replicas)."""
        j = int(self.dst_chunk[me])
        if j < 0:
            return np.zeros(0, dtype=np.int64), -1
        ids, start = self.replicas()
        pos = int(np.searchsorted(ids[start[j] : start[j + 1]], me))
        rows = np.flatnonzero((self.target_chunk == j) & (self.lo <= pos) & (pos < self.hi))
        return rows[self.source_chunk[rows] != self.src_chunk[me]], pos
