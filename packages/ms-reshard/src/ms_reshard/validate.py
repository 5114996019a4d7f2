"""Checking a plan without running it: every target element is obtained once, from a rank that holds it.

This is the validator a loaded or hand-edited plan goes through before an executor trusts it; it
re-derives every box from the layouts rather than trusting the plan's own bookkeeping.
"""

from __future__ import annotations

import numpy as np

from .errors import ReshardError
from .plan import OpKind, TensorPlan, box_elems


def _owned_boxes(plan: TensorPlan, side: str) -> tuple[np.ndarray, np.ndarray]:
    """[n_ids, ndim, 2] box of every id on one side, and a mask of the ids on that side."""
    from .planner import chunk_indices

    layout = plan.src if side == "src" else plan.dst
    shard = np.asarray(layout.shard_shape(plan.shape), dtype=np.int64)
    ids = np.searchsorted(plan.ranks, np.asarray(layout.ranks, dtype=np.int64))
    if (ids >= len(plan.ranks)).any() or not np.array_equal(plan.ranks[ids], layout.ranks):
        raise ReshardError(f"plan's ranks {plan.ranks.tolist()[:16]} do not include the {side} ranks")
    boxes = np.zeros((len(plan.ranks), len(plan.shape), 2), dtype=np.int64)
    lo = chunk_indices(layout) * shard
    boxes[ids, :, 0], boxes[ids, :, 1] = lo, lo + shard
    mask = np.zeros(len(plan.ranks), dtype=bool)
    mask[ids] = True
    return boxes, mask


def _inside(box: np.ndarray, outer: np.ndarray) -> np.ndarray:
    return ((box[..., 0] >= outer[..., 0]) & (box[..., 1] <= outer[..., 1]) & (box[..., 0] < box[..., 1])).all(-1)


def validate(plan: TensorPlan) -> None:
    """Raise ReshardError naming the first rank whose part of the plan is wrong."""
    src_box, in_src = _owned_boxes(plan, "src")
    dst_box, in_dst = _owned_boxes(plan, "dst")
    # Every piece a rank obtains: (receiver id, box, sender id or -1 for a local copy)
    x_src, x_dst, _, x_box, _ = plan.transfers()  # multicasts spelled out
    recv = [plan.copy_id, x_dst]
    send = [plan.copy_id, x_src]
    boxes = [plan.copy_box, x_box]
    for col in plan.collectives:
        for i, s in enumerate(col.members):
            for j, r in enumerate(col.members):
                if i != j:
                    recv.append(np.array([r]))
                    send.append(np.array([s]))
                    b = col.boxes[i] if col.kind is OpKind.ALL_GATHER else col.boxes[i, j]
                    boxes.append(b[None])
    r, s = np.concatenate(recv), np.concatenate(send)
    b = np.concatenate([x.reshape(len(x), len(plan.shape), 2) for x in boxes])
    for what, ids, mask, owned in (("sends", s, in_src, src_box), ("receives", r, in_dst, dst_box)):
        bad = ~(mask[ids] & _inside(b, owned[ids]))
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise ReshardError(
                f"rank {int(plan.ranks[ids[k]])} {what} box {b[k].tolist()} outside its shard {owned[ids[k]].tolist()}"
            )
    got = np.bincount(r, weights=box_elems(b), minlength=len(plan.ranks))
    want = np.where(in_dst, box_elems(dst_box), 0)
    if not np.array_equal(got, want):
        k = int(np.flatnonzero(got != want)[0])
        raise ReshardError(f"rank {int(plan.ranks[k])} obtains {int(got[k])} elements; its target shard has {want[k]}")
    _check_disjoint(plan, r, b)
    over = np.flatnonzero(plan.received > plan.lower_bound)
    if len(over) and not plan.notes:
        k = int(over[0])
        raise ReshardError(
            f"rank {int(plan.ranks[k])} receives {int(plan.received[k])} B, more than its lower bound "
            f"{int(plan.lower_bound[k])} B, and the plan gives no reason"
        )


def _check_disjoint(plan: TensorPlan, recv: np.ndarray, boxes: np.ndarray) -> None:
    # Equal element counts plus containment leave only overlaps to rule out; compare the boxes of
    # each rank pairwise (vectorized per rank; plans have few pieces per rank).
    order = np.argsort(recv, kind="stable")
    r, b = recv[order], boxes[order]
    starts = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
    for lo, hi in zip(starts, np.r_[starts[1:], len(r)]):
        group = b[lo:hi]
        if len(group) < 2:
            continue
        a, c = group[:, None], group[None, :]
        overlap = ((np.minimum(a[..., 1], c[..., 1]) - np.maximum(a[..., 0], c[..., 0])) > 0).all(-1)
        np.fill_diagonal(overlap, False)
        if overlap.any():
            i, j = np.argwhere(overlap)[0]
            raise ReshardError(
                f"rank {int(plan.ranks[r[lo]])} obtains overlapping boxes {group[i].tolist()} and {group[j].tolist()}"
            )
