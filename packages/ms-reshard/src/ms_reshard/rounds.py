"""Bounding the memory held in flight: splitting a plan's transfers into rounds under a cap.

In one round a rank holds a packed buffer for each box it sends and each box it receives (and the
input and output buffers of its collectives); the target shard itself is the result, not counted.
With a cap, transfers bigger than the cap are cut into row blocks that fit, collectives whose
buffers do not fit are lowered back to point-to-point transfers (same bytes), and each unit goes to
the first round in which every rank it involves still has room -- first fit, in plan order.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .plan import Collective, OpKind, box_elems


def split_box(box: np.ndarray, max_elems: int) -> list[np.ndarray]:
    """Cut a [ndim, 2] box into row-major blocks of at most `max_elems` elements."""
    extent = box[:, 1] - box[:, 0]
    if math.prod(extent.tolist()) <= max_elems:
        return [box]
    ndim = len(extent)
    inner = [math.prod(extent[d + 1 :].tolist()) for d in range(ndim)]
    d = next(d for d in range(ndim) if inner[d] <= max_elems)  # the last dim always qualifies
    step = max(1, max_elems // inner[d])
    outer = np.indices(extent[:d]).reshape(d, -1).T if d else np.zeros((1, 0), dtype=np.int64)
    out = []
    for idx in outer:
        for start in range(0, int(extent[d]), step):
            sub = box.copy()
            sub[:d, 0] = box[:d, 0] + idx
            sub[:d, 1] = sub[:d, 0] + 1
            sub[d] = (box[d, 0] + start, box[d, 0] + min(start + step, int(extent[d])))
            out.append(sub)
    return out


def _lower(col: Collective) -> list[tuple[int, int, np.ndarray]]:
    """The point-to-point transfers a collective stands for."""
    out = []
    for i, s in enumerate(col.members):
        for j, r in enumerate(col.members):
            if i != j:
                out.append((s, r, col.boxes[i] if col.kind is OpKind.ALL_GATHER else col.boxes[i, j]))
    return out


class _Rooms:
    """Bytes already booked per id and round; finds the first round where a unit fits."""

    def __init__(self, cap: int):
        self.cap = cap
        self.used: dict[int, list[int]] = {}

    def place(self, needs: dict[int, int]) -> int:
        rnd = 0
        while True:
            if all(self._used(i, rnd) + n <= self.cap for i, n in needs.items()):
                for i, n in needs.items():
                    self.used[i][rnd] += n
                return rnd
            rnd += 1

    def _used(self, i: int, rnd: int) -> int:
        rows = self.used.setdefault(i, [])
        while len(rows) <= rnd:
            rows.append(0)
        return rows[rnd]


def assign_rounds(
    cols: list[Collective],
    sender: np.ndarray,
    recv: np.ndarray,
    boxes: np.ndarray,
    itemsize: int,
    mem_cap: int | None,
    n_ids: int,
) -> tuple[np.ndarray, list[Collective], tuple[np.ndarray, np.ndarray, np.ndarray], list[str]]:
    """Rounds of the transfers and collectives; returns (transfer rounds, collectives, transfers, notes)."""
    if mem_cap is None:
        return np.zeros(len(sender), dtype=np.int64), cols, (sender, recv, boxes), []
    notes = []
    kept, lowered = [], []
    for col in cols:
        (kept if col.buffer_elems() * itemsize <= mem_cap else lowered).append(col)
    xfers = list(zip(sender.tolist(), recv.tolist(), boxes))
    for col in lowered:
        xfers += _lower(col)
    if lowered:
        notes.append(f"mem_cap {mem_cap} B: {len(lowered)} collectives lowered to point-to-point (same bytes)")
    max_elems = mem_cap // itemsize
    split = [(s, r, sub) for s, r, box in xfers for sub in split_box(np.asarray(box), max_elems)]
    if len(split) > len(xfers):
        notes.append(f"mem_cap {mem_cap} B: {len(xfers)} transfers cut into {len(split)} blocks")
    rooms = _Rooms(mem_cap)
    placed = []
    for col in kept:
        need = col.buffer_elems() * itemsize
        placed.append(dataclasses.replace(col, round=rooms.place(dict.fromkeys(col.members, need))))
    ndim = boxes.shape[1]
    out_s = np.array([s for s, _, _ in split], dtype=np.int64)
    out_r = np.array([r for _, r, _ in split], dtype=np.int64)
    out_b = np.array([b for _, _, b in split], dtype=np.int64).reshape(len(split), ndim, 2)
    need = box_elems(out_b) * itemsize
    rounds = np.array([rooms.place({s: n, r: n}) for s, r, n in zip(out_s.tolist(), out_r.tolist(), need.tolist())])
    order = np.argsort(rounds, kind="stable")
    rounds = rounds.astype(np.int64).reshape(-1)
    return rounds[order], placed, (out_s[order], out_r[order], out_b[order]), notes
