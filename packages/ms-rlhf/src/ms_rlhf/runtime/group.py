"""Process groups for the trainer: ms_layout.comm's when several ranks run, a trivial one for one.

A single process needs no communication library at all (no torch import, no rendezvous): the
reshard plans of one rank are local copies, and every collective is the identity.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class SingleProcessGroup:
    """The ms_layout.comm ProcessGroup protocol for a world of one rank."""

    backend = "local"
    rank = 0
    size = 1
    ranks = (0,)

    def all_reduce(self, array: np.ndarray, op: str = "sum", async_op: bool = False) -> None:
        return None

    def all_gather(self, array: np.ndarray, axis: int = 0) -> np.ndarray:
        return np.array(array, copy=True)

    def broadcast(self, array: np.ndarray, src: int = 0, async_op: bool = False) -> None:
        return None

    def barrier(self) -> None:
        return None

    def batch_isend_irecv(self, ops: list) -> list:
        if ops:
            raise RuntimeError("a single-process group has no peers to send to")
        return []

    def new_group(self, ranks: Sequence[int]) -> SingleProcessGroup:
        return self


def world_group(group=None):
    """`group` if given, else ms_layout.comm's world when initialised, else a single-process group."""
    if group is not None:
        return group
    from ms_layout import comm

    return comm.world() if comm.is_initialized() else SingleProcessGroup()


def all_gather_objects(group, rows: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Every rank's list of 1-d int arrays (variable lengths), gathered to every rank."""
    if group.size == 1:
        return [rows]
    lengths = np.array([len(r) for r in rows], np.int64)
    counts = group.all_gather(np.array([len(rows)], np.int64))
    width = np.array([lengths.max() if len(lengths) else 0], np.int64)
    group.all_reduce(width, op="max")
    most = int(counts.max())
    buf = np.full((most, int(width[0]) + 1), -1, np.int64)
    for i, r in enumerate(rows):
        buf[i, 0] = len(r)
        buf[i, 1 : 1 + len(r)] = r
    gathered = group.all_gather(buf[None], axis=0)
    out = []
    for k in range(group.size):
        out.append([gathered[k, i, 1 : 1 + gathered[k, i, 0]].copy() for i in range(int(counts[k]))])
    return out


def tp_and_dp_groups(group, tp: int):
    """(tensor-parallel group, data-parallel group) of this rank: tp consecutive ranks form a TP
    group, the ranks at the same place in each form a DP group (tp=1: no TP group, DP = `group`)."""
    if tp == 1:
        return None, group
    ranks, dp = list(group.ranks), group.size // tp
    tp_group = group.split([ranks[d * tp : (d + 1) * tp] for d in range(dp)])
    dp_group = group.split([ranks[t::tp] for t in range(tp)]) if dp > 1 else SingleProcessGroup()
    return tp_group, dp_group
