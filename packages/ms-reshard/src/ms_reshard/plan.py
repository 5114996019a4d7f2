"""A reshard plan as data: which box of the global tensor each rank copies, sends and receives.

The plan stores its operations as columns of numpy arrays (one row per copy, transfer or
collective) rather than as per-rank object lists, so that plans for thousands of ranks stay small
and can be shared by every parameter with the same layouts and shape. Every rank field holds an
*id*: an index into ``TensorPlan.ranks``, the sorted global ranks the plan touches. Two tensors
whose rank sets differ only by an order-preserving relabeling (another pipeline stage, another
expert owner) therefore share the same arrays and differ only in ``ranks``.

A box is ``[ndim, 2]`` ints: the half-open ``[start, stop)`` range of every dim of the global tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from ms_layout import Layout

from .multicast import Multicast

Box = tuple[tuple[int, int], ...]


class OpKind(str, Enum):
    """What one operation of a rank does."""

    COPY = "copy"
    SEND = "send"
    RECV = "recv"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"


@dataclass(frozen=True)
class Op:
    """One step of one rank's part of a plan."""

    kind: OpKind
    """The kind of operation."""
    round: int
    """The round it runs in; rounds run in order and bound the memory held in flight."""
    box: Box
    """Global box moved: copied, sent or received; for a collective, this rank's own piece."""
    peer: int | None = None
    """Global rank sent to or received from (send/recv only)."""
    group: tuple[int, ...] | None = None
    """Global ranks of a collective, in group-rank order (collectives only)."""
    index: int = 0
    """Row of the copy, transfer or collective in the plan, so peers match each other's ops."""

    def __str__(self) -> str:
        box = "[" + ", ".join(f"{a}:{b}" for a, b in self.box) + "]"
        if self.kind is OpKind.SEND:
            return f"r{self.round} send {box} to {self.peer}"
        if self.kind is OpKind.RECV:
            return f"r{self.round} recv {box} from {self.peer}"
        if self.kind is OpKind.COPY:
            return f"r{self.round} copy {box}"
        if self.kind is OpKind.ALL_GATHER:
            return f"r{self.round} all_gather #{self.index} over {list(self.group or ())} (own piece {box})"
        return f"r{self.round} all_to_all #{self.index} over {list(self.group or ())}"


@dataclass(frozen=True, eq=False)
class Collective:
    """A group of point-to-point transfers replaced by one collective that moves the same bytes."""

    kind: OpKind
    """ALL_GATHER (each member's piece goes to every other member) or ALL_TO_ALL."""
    members: tuple[int, ...]
    """Ids of the members, ascending (= group-rank order of the process group)."""
    boxes: np.ndarray
    """ALL_GATHER: [k, ndim, 2], member i's piece; ALL_TO_ALL: [k, k, ndim, 2], box i sends to j
    (the diagonal is an empty placeholder: a member's own part is a local copy)."""
    elems: int
    """Elements in every piece (equal pieces are what lets a collective replace the transfers)."""
    round: int = 0
    """The round the collective runs in."""

    def piece(self, member: int) -> np.ndarray:
        """The [ndim, 2] box this member contributes (ALL_GATHER) or its diagonal placeholder."""
        i = self.members.index(member)
        return self.boxes[i] if self.kind is OpKind.ALL_GATHER else self.boxes[i, i]

    def buffer_elems(self) -> int:
        """Elements a member holds in flight: input plus output buffers."""
        k = len(self.members)
        return (k + 1) * self.elems if self.kind is OpKind.ALL_GATHER else 2 * k * self.elems


def box_tuple(box: np.ndarray) -> Box:
    """A [ndim, 2] array as a tuple of (start, stop) pairs."""
    return tuple((int(a), int(b)) for a, b in box)


def box_elems(boxes: np.ndarray) -> np.ndarray:
    """Elements in each of a stack of boxes [..., ndim, 2]."""
    extent = boxes[..., 1] - boxes[..., 0]
    if extent.shape[-1] == 0:
        return np.ones(extent.shape[:-1], dtype=np.int64)
    out = extent[..., 0].astype(np.int64)
    for d in range(1, extent.shape[-1]):  # a loop over dims beats np.prod's reduction on [n, 2] rows
        out = out * extent[..., d]
    return out


@dataclass(frozen=True, eq=False)
class TensorPlan:
    """How to move one tensor from the `src` layout to the `dst` layout."""

    src: Layout
    """Layout (with its ranks) the tensor is held in before."""
    dst: Layout
    """Layout (with its ranks) the tensor is wanted in after."""
    shape: tuple[int, ...]
    """Global shape of the tensor."""
    itemsize: int
    """Bytes per element, for the byte counts."""
    mem_cap: int | None
    """Bound on the bytes of buffers one rank holds in flight in one round (None: unbounded)."""
    ranks: np.ndarray
    """Sorted global ranks the plan touches; every id below indexes this array."""
    copy_id: np.ndarray
    """Per local copy: the id of the rank copying from its source shard into its target shard."""
    copy_box: np.ndarray
    """Per local copy: the global box copied, [n, ndim, 2]."""
    xfer_src: np.ndarray
    """Per point-to-point transfer: id of the sender."""
    xfer_dst: np.ndarray
    """Per point-to-point transfer: id of the receiver."""
    xfer_round: np.ndarray
    """Per point-to-point transfer: its round."""
    xfer_box: np.ndarray
    """Per point-to-point transfer: the global box sent, [n, ndim, 2]."""
    collectives: tuple[Collective, ...]
    """Collectives, in the global order every member runs them."""
    sent: np.ndarray
    """Bytes each id sends (over the network, collectives included)."""
    received: np.ndarray
    """Bytes each id receives."""
    lower_bound: np.ndarray
    """Bytes of each id's target shard that its source shard does not hold: what it must receive."""
    rounds: int
    """Number of rounds (1 unless the memory cap split the work)."""
    notes: tuple[str, ...] = field(default=())
    """Why a rank receives more than its lower bound, or anything else a reader should know."""
    multicast: Multicast | None = None
    """Boxes sent by one rank to many replicas of a target chunk, one row each (multicast.py);
    None when every transfer is point-to-point. Their transfers follow the point-to-point ones."""

    # ---------------------------------------------------------------- queries
    @property
    def ndim(self) -> int:
        """Number of tensor dims."""
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole global tensor."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize

    def rank_id(self, rank: int) -> int:
        """The id of a global rank in this plan (-1 if the plan does not touch it)."""
        i = int(np.searchsorted(self.ranks, rank))
        return i if i < len(self.ranks) and self.ranks[i] == rank else -1

    def bytes_moved(self) -> int:
        """Total bytes received over the network."""
        return int(self.received.sum())

    def lower_bound_total(self) -> int:
        """Sum of the per-rank lower bounds."""
        return int(self.lower_bound.sum())

    def relabel(self, src: Layout, dst: Layout, ranks: np.ndarray) -> TensorPlan:
        """The same plan for layouts whose ranks are an order-preserving relabeling of these."""
        # dataclasses.replace re-runs __init__, copy.copy goes through __reduce_ex__: thousands of
        # relabels add up
        out = object.__new__(TensorPlan)
        out.__dict__.update(self.__dict__, src=src, dst=dst, ranks=ranks)
        return out

    def transfers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every point-to-point transfer, multicasts spelled out: (sender ids, receiver ids, rounds,
        boxes, indices). Indices are what the op lists carry; both ends of a transfer share one."""
        mc, n = self.multicast, len(self.xfer_src)
        if mc is None or not len(mc):
            return self.xfer_src, self.xfer_dst, self.xfer_round, self.xfer_box, np.arange(n)
        row, recv, pos = mc.expand()
        return (
            np.concatenate([self.xfer_src, mc.src[row]]),
            np.concatenate([self.xfer_dst, recv]),
            np.concatenate([self.xfer_round, np.zeros(len(row), dtype=np.int64)]),
            np.concatenate([self.xfer_box, mc.box[row]]),
            np.concatenate([np.arange(n), n + row * mc.width() + pos]),
        )

    def traffic_matrix(self) -> np.ndarray:
        """[n, n] bytes sent from ranks[i] to ranks[j], collectives included (a picture of the plan)."""
        n = len(self.ranks)
        out = np.zeros((n, n), dtype=np.int64)
        src, dst, _, boxes, _ = self.transfers()
        np.add.at(out, (src, dst), box_elems(boxes))
        for col in self.collectives:
            for i in col.members:
                for j in col.members:
                    out[i, j] += col.elems if i != j else 0
        return out * self.itemsize

    def per_rank(self) -> list[dict]:
        """Per global rank: bytes sent, received and the lower bound."""
        return [
            {
                "rank": int(r),
                "sent": int(s),
                "received": int(v),
                "lower_bound": int(lb),
            }
            for r, s, v, lb in zip(self.ranks, self.sent, self.received, self.lower_bound)
        ]

    # ---------------------------------------------------------------- per-rank op lists
    def ops_by_rank(self) -> dict[int, list[Op]]:
        """Every rank's ordered ops. Per round: local copies (round 0), collectives in global order,
        then sends and receives in transfer order (both ends see the same order, so messages match)."""
        out: dict[int, list[Op]] = {int(r): [] for r in self.ranks}
        ranks = self.ranks
        for rnd in range(self.rounds):
            if rnd == 0:
                for i, (cid, box) in enumerate(zip(self.copy_id, self.copy_box)):
                    out[int(ranks[cid])].append(Op(OpKind.COPY, 0, box_tuple(box), index=i))
            for i, col in enumerate(self.collectives):
                if col.round != rnd:
                    continue
                group = tuple(int(ranks[m]) for m in col.members)
                for m in col.members:
                    out[int(ranks[m])].append(Op(col.kind, rnd, box_tuple(col.piece(m)), group=group, index=i))
            src, dst, rounds, boxes, index = self.transfers()
            for i in np.flatnonzero(rounds == rnd):
                s, d = int(ranks[src[i]]), int(ranks[dst[i]])
                box = box_tuple(boxes[i])
                out[s].append(Op(OpKind.SEND, rnd, box, peer=d, index=int(index[i])))
                out[d].append(Op(OpKind.RECV, rnd, box, peer=s, index=int(index[i])))
        return out

    def rank_ops(self, rank: int) -> list[Op]:
        """The ordered ops of one global rank (empty if the plan does not touch it); the same
        order as ops_by_rank, computed for this rank only."""
        me = self.rank_id(rank)
        if me < 0:
            return []
        ranks, out = self.ranks, []
        for rnd in range(self.rounds):
            if rnd == 0:
                for i in np.flatnonzero(self.copy_id == me):
                    out.append(Op(OpKind.COPY, 0, box_tuple(self.copy_box[i]), index=int(i)))
            for i, col in enumerate(self.collectives):
                if col.round == rnd and me in col.members:
                    group = tuple(int(ranks[m]) for m in col.members)
                    out.append(Op(col.kind, rnd, box_tuple(col.piece(me)), group=group, index=i))
            mine = (self.xfer_round == rnd) & ((self.xfer_src == me) | (self.xfer_dst == me))
            for i in np.flatnonzero(mine):
                box = box_tuple(self.xfer_box[i])
                if self.xfer_src[i] == me:
                    out.append(Op(OpKind.SEND, rnd, box, peer=int(ranks[self.xfer_dst[i]]), index=int(i)))
                else:
                    out.append(Op(OpKind.RECV, rnd, box, peer=int(ranks[self.xfer_src[i]]), index=int(i)))
            if rnd == 0 and self.multicast is not None and len(self.multicast):
                out += self._multicast_ops(me)
        return out

    def _multicast_ops(self, me: int) -> list[Op]:
        """One rank's sends and receives of the multicast rows, in the order ops_by_rank has them:
        by row, and within a row by receiver position (a rank is never both ends of one row)."""
        mc, ranks, n = self.multicast, self.ranks, len(self.xfer_src)
        width, ops = mc.width(), []
        rows, recv, pos = mc.expand(np.flatnonzero(mc.src == me))
        got, my_pos = mc.received_rows(me)
        for i, r, p in zip(rows, recv, pos):
            index = n + int(i) * width + int(p)
            ops.append((int(i), Op(OpKind.SEND, 0, box_tuple(mc.box[i]), peer=int(ranks[r]), index=index)))
        for i in got:
            index = n + int(i) * width + my_pos
            ops.append((int(i), Op(OpKind.RECV, 0, box_tuple(mc.box[i]), peer=int(ranks[mc.src[i]]), index=index)))
        ops.sort(key=lambda t: t[0])  # stable: a row's sends keep their position order
        return [op for _, op in ops]

    def sources_by_rank(self) -> dict[int, list[tuple[int, Box]]]:
        """For every target rank, (source rank, global box) of every piece of its target shard,
        whichever op brings it (a copy's source is the rank itself). Offline readers use this."""
        ranks = self.ranks
        out: dict[int, list[tuple[int, Box]]] = {int(r): [] for r in self.dst.ranks}
        for cid, box in zip(self.copy_id, self.copy_box):
            out[int(ranks[cid])].append((int(ranks[cid]), box_tuple(box)))
        src, dst, _, boxes, _ = self.transfers()
        for s, d, box in zip(src, dst, boxes):
            out[int(ranks[d])].append((int(ranks[s]), box_tuple(box)))
        for col in self.collectives:
            for i, s in enumerate(col.members):
                for j, d in enumerate(col.members):
                    if i != j:
                        box = col.boxes[i] if col.kind is OpKind.ALL_GATHER else col.boxes[i, j]
                        out[int(ranks[d])].append((int(ranks[s]), box_tuple(box)))
        return out

    def iter_collective_groups(self) -> Iterator[tuple[int, ...]]:
        """Global ranks of every collective's group, in plan order."""
        for col in self.collectives:
            yield tuple(int(self.ranks[m]) for m in col.members)

    # ---------------------------------------------------------------- text
    def __str__(self) -> str:
        return format_plan(self)


def naive_gather_bytes(plan: TensorPlan) -> int:
    """Bytes received by the gather-everything-then-slice plan: every target rank receives the whole
    tensor except the source shard it may hold itself."""
    nbytes = plan.nbytes
    both = len(plan.src.ranks) + len(plan.dst.ranks) - len(plan.ranks)  # plan.ranks is their union
    return nbytes * len(plan.dst.ranks) - nbytes // math.prod(plan.src.splits) * both


def format_plan(plan: TensorPlan, max_ranks: int = 16, ops: bool = True) -> str:
    """Header, a per-rank byte table and (for up to `max_ranks` ranks) each rank's ops."""
    lines = [
        f"TensorPlan shape={plan.shape} itemsize={plan.itemsize} rounds={plan.rounds}"
        + (f" mem_cap={plan.mem_cap}" if plan.mem_cap else ""),
        f"  src {plan.src}  ranks {_ranges(plan.src.ranks)}",
        f"  dst {plan.dst}  ranks {_ranges(plan.dst.ranks)}",
        f"  moved {plan.bytes_moved()} B, lower bound {plan.lower_bound_total()} B; "
        f"{len(plan.copy_id)} copies, {len(plan.xfer_src)} transfers, {len(plan.collectives)} collectives"
        + (f", {len(plan.multicast)} multicasts" if plan.multicast is not None else ""),
    ]
    lines += [f"  note: {n}" for n in plan.notes]
    lines.append(f"  {'rank':>6} {'sent':>12} {'received':>12} {'lower bound':>12}")
    rows = plan.per_rank()
    for row in rows[:max_ranks]:
        lines.append(f"  {row['rank']:>6} {row['sent']:>12} {row['received']:>12} {row['lower_bound']:>12}")
    if len(rows) > max_ranks:
        lines.append(f"  ... {len(rows) - max_ranks} more ranks")
    if ops:
        by_rank = plan.ops_by_rank()
        for rank in list(by_rank)[:max_ranks]:
            lines.append(f"  rank {rank}:")
            lines += [f"    {op}" for op in by_rank[rank]] or ["    (nothing)"]
    return "\n".join(lines)


def _ranges(ranks: tuple[int, ...]) -> str:
    """Compact text of a rank list: 0-3,8-11."""
    parts: list[str] = []
    start = prev = None
    for r in ranks:
        if start is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = r
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(parts)
