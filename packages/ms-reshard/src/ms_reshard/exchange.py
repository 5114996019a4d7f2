"""Running one rank's part of a plan over a process group (ms_layout.comm), on numpy buffers.

Every rank of the plan calls ``run_plan`` with the same plan; each walks its own op list
(``TensorPlan.rank_ops``) round by round: local copies, then its collectives in the plan's global
order, then all its sends and receives of the round as one ``batch_isend_irecv``. Because every
rank meets the collectives in the same order and a round's messages only need peers that finished
the previous rounds, the schedule cannot deadlock. Nothing here imports torch or MindSpore: the
group is any object following ``ms_layout.comm.ProcessGroup``.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import numpy as np

from .errors import ReshardError
from .local import contribution, local_slices, place_result
from .plan import OpKind, TensorPlan

# gloo moves these dtypes; anything else (bfloat16, int16) travels as raw bits of a same-size one.
_WIRE = {1: np.uint8, 2: np.float16, 4: np.int32, 8: np.int64}
_GLOO_OK = {np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64)}


def wire(buf: np.ndarray) -> np.ndarray:
    """A view of `buf` in a dtype the backend can move, bit for bit (no conversion)."""
    if buf.dtype in _GLOO_OK:
        return buf
    if buf.dtype.itemsize not in _WIRE:
        raise ReshardError(f"cannot move dtype {buf.dtype}")
    return buf.view(_WIRE[buf.dtype.itemsize])


def make_groups(plans: Iterable[TensorPlan], group) -> dict[tuple[int, ...], object]:
    """Create the sub-groups of every collective this rank takes part in, in the plans' order
    (only members create a group, as ms_layout.comm requires; the shared order avoids deadlock)."""
    me, out = _global(group, group.rank), {}
    for p in plans:
        for ranks in p.iter_collective_groups():
            if me in ranks and ranks not in out:
                out[ranks] = group.new_group([_local(group, r) for r in ranks])
    return out


def _global(group, rank: int) -> int:
    return int(group.ranks[rank])


def _local(group, rank: int) -> int:
    try:
        return group.ranks.index(rank)
    except ValueError:
        raise ReshardError(f"plan rank {rank} is not in the process group {list(group.ranks)}") from None


def run_plan(
    plan: TensorPlan,
    group,
    src: np.ndarray | None,
    out: np.ndarray | None,
    subgroups: dict | None = None,
    collectives: bool = True,
    dtype: np.dtype | None = None,
) -> None:
    """This rank's part of `plan`: read from its source shard `src`, write its target shard `out`.

    `src` is None on ranks outside the source layout, `out` None outside the target layout.
    `dtype` is the source dtype, what travels (default: src's, else out's); values are cast to
    out's dtype on arrival. With collectives=False (or when a sub-group is missing) collectives
    run as point-to-point."""
    run_plans([(plan, src, out, dtype)], group, subgroups, collectives, bucket_bytes=None)


DEFAULT_BUCKET = 64 << 20


def run_plans(
    items, group, subgroups=None, collectives: bool = True, bucket_bytes: int | None = DEFAULT_BUCKET
) -> None:
    """Run several plans -- (plan, src, out, dtype) each, as for run_plan -- with round r of every
    plan in a bucket sharing one batch of point-to-point messages: a model's hundreds of small
    tensors then cost a few batches, not one each. Buckets are cut (identically on every rank, from
    plan-wide numbers) so that their plans' largest per-rank traffic adds up to `bucket_bytes`."""
    me = _global(group, group.rank)
    jobs = [_job(p, s, o, d, me) for p, s, o, d in items]
    subgroups = subgroups if subgroups is not None else {}
    for bucket in _buckets(jobs, bucket_bytes):
        for rnd in range(max(j["plan"].rounds for j in bucket)):
            copies: list = []
            sends: list = []
            recvs: list = []
            for job in bucket:
                _round(job, rnd, me, copies, sends, recvs, subgroups, collectives)
            _exchange(group, sends, recvs, copies)


def _job(plan: TensorPlan, src, out, dtype, me: int) -> dict:
    in_src, in_dst = me in plan.src.ranks, me in plan.dst.ranks
    if (src is None) == in_src or (out is None) == in_dst:
        raise ReshardError(f"rank {me}: src given={src is not None}, out given={out is not None}; the plan says "
                           f"{in_src=} {in_dst=}")  # fmt: skip
    ops, src_at, dst_at, shards = _static(plan, me, in_src, in_dst)
    return {
        "plan": plan,
        "src": src,
        "out": out,
        "ops": ops,
        "src_at": src_at,
        "dst_at": dst_at,
        "shards": shards,
        "dtype": np.dtype(dtype) if dtype is not None else (src.dtype if src is not None else out.dtype),
    }


_STATIC: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per plan object (not per arrays: a relabeled plan shares them but not its ranks): rank -> _static."""


def _static(plan: TensorPlan, me: int, in_src: bool, in_dst: bool) -> tuple:
    """(op list, source origin, target origin, both shard shapes) of rank `me`, kept on the plan: a
    reshard run every step (RLHF weight sync) then walks ready lists instead of re-deriving them."""
    memo = _STATIC.setdefault(plan, {})
    found = memo.get(me)
    if found is None:
        found = memo[me] = (
            plan.rank_ops(me),
            tuple(s.start for s in plan.src.global_slice(plan.shape, me)) if in_src else (),
            tuple(s.start for s in plan.dst.global_slice(plan.shape, me)) if in_dst else (),
            (plan.src.shard_shape(plan.shape), plan.dst.shard_shape(plan.shape)),
        )
    return found


DIRECT_BYTES = 256 << 10
"""Boxes from this size on that are one contiguous block of the source shard or of the target shard
travel as their own message: sent straight from the source shard where it is contiguous there, and
received straight into the target shard where it is contiguous there (no pack, no unpack on that
side); smaller ones share the per-peer message, where one copy costs less than one more message."""


def _direct(shards: tuple, box, itemsize: int) -> bool:
    """Whether `box` travels as its own message. Both ends decide alike: from the box and the two
    shard shapes, which the plan gives both, not from their own arrays."""
    extent = [b - a for a, b in box]
    if math.prod(extent) * itemsize < DIRECT_BYTES:
        return False
    return any(_contiguous(extent, shape) for shape in shards)


def _contiguous(extent: list[int], shape: tuple[int, ...]) -> bool:
    """Whether a box of `extent` is one C-order block of an array of `shape`: after the leading
    dims of extent 1, at most one dim is partial and every later dim is whole."""
    k = 0
    while k < len(extent) and extent[k] == 1:
        k += 1
    return all(e == n for e, n in zip(extent[k + 1 :], shape[k + 1 :]))


def _buckets(jobs: list[dict], bucket_bytes: int | None) -> list[list[dict]]:
    if bucket_bytes is None:
        return [[j] for j in jobs]
    out: list[list[dict]] = []
    used = 0
    for job in jobs:
        p = job["plan"]
        cost = int((p.sent + p.received).max(initial=0)) if p.mem_cap is None else p.mem_cap
        if not out or used + cost > bucket_bytes:
            out.append([])
            used = 0
        out[-1].append(job)
        used += cost
    return out


def _round(
    job: dict, rnd: int, me: int, copies: list, sends: list, recvs: list, subgroups: dict, collectives: bool
) -> None:
    """One plan's ops of one round: collectives now; local copies as (target view, source view) and
    messages as (peer, source view) and (peer, target view, dtype on the wire) for the round's
    shared exchange, which runs the copies while the messages are in flight."""
    plan, src, out, src_at, dst_at, dtype = (job[k] for k in ("plan", "src", "out", "src_at", "dst_at", "dtype"))
    shards, size = job["shards"], job["dtype"].itemsize
    for op in job["ops"]:
        if op.round != rnd:
            continue
        if op.kind is OpKind.COPY:
            copies.append((out[local_slices(op.box, dst_at)], src[local_slices(op.box, src_at)]))
        elif op.kind is OpKind.SEND:
            sends.append((op.peer, src[local_slices(op.box, src_at)], _direct(shards, op.box, size)))
        elif op.kind is OpKind.RECV:
            recvs.append((op.peer, out[local_slices(op.box, dst_at)], dtype, _direct(shards, op.box, size)))
        elif collectives and op.group in subgroups:
            _collective(plan, op.index, me, subgroups[op.group], src, src_at, out, dst_at)
        else:
            _as_p2p(plan, op.index, me, src, src_at, out, dst_at, dtype, sends, recvs, shards)


def _collective(plan, index, me, sub, src, src_at, out, dst_at) -> None:
    col = plan.collectives[index]
    buf = contribution(plan, index, me, src, src_at)
    if col.kind is OpKind.ALL_GATHER:
        result = sub.all_gather(wire(buf), axis=0)
    else:
        result = sub.all_to_all(wire(buf), split_axis=0, concat_axis=0)
    place_result(plan, index, me, result.view(buf.dtype), out, dst_at)


def _as_p2p(plan, index, me, src, src_at, out, dst_at, dtype, sends: list, recvs: list, shards: tuple) -> None:
    """A collective's transfers for this rank, as point-to-point entries of the round's exchange."""
    col = plan.collectives[index]
    i = col.members.index(plan.rank_id(me))
    for j, m in enumerate(col.members):
        if j == i:
            continue
        peer = int(plan.ranks[m])
        mine = col.boxes[i] if col.kind is OpKind.ALL_GATHER else col.boxes[i, j]
        theirs = col.boxes[j] if col.kind is OpKind.ALL_GATHER else col.boxes[j, i]
        mine, theirs = tuple(map(tuple, mine.tolist())), tuple(map(tuple, theirs.tolist()))
        sends.append((peer, src[local_slices(mine, src_at)], _direct(shards, mine, dtype.itemsize)))
        recvs.append((peer, out[local_slices(theirs, dst_at)], dtype, _direct(shards, theirs, dtype.itemsize)))


def _exchange(group, sends: list, recvs: list, copies: list = ()) -> None:
    """Send and receive a round's boxes with at most one shared message per peer and direction.

    Both ends list the boxes between them in the same order (the plan's). Big boxes that are one
    contiguous block of either shard (`_direct`) travel as their own messages: sent straight from
    the source shard when they are contiguous there, received straight into the target shard when
    they are contiguous there. The sender packs the other boxes for a peer into one buffer and the
    receiver unpacks it straight into its target views: at most one copy on each side, and one
    shared message per pair however many small pieces it moves. Between a pair, the own messages
    go first and the shared one last, on both ends: that order is how they match. Receives are
    listed before sends in the one batch (one batch per round: a backend whose batches run in
    stream order would deadlock on a batch of receives waiting for sends queued behind it). The
    local copies -- straight from the source shard into the target shard, no buffer -- run
    between posting the messages and waiting for them, behind the transfer."""
    if not sends and not recvs:
        for target, source in copies:
            target[...] = source
        return
    from ms_layout.comm import P2POp

    ops, unpacks = [], []
    by_peer: dict[int, list] = {}
    for peer, target, dtype, direct in recvs:
        by_peer.setdefault(peer, []).append((target, dtype, direct))
    for peer, items in by_peer.items():
        rank = _local(group, peer)
        for target, dtype, direct in items:
            if direct:
                ops.append(_receive([(target, dtype)], rank, unpacks))
        packed = [(t, d) for t, d, direct in items if not direct]
        if sum(t.size * d.itemsize for t, d in packed):
            ops.append(_receive(packed, rank, unpacks))
    by_peer = {}
    for peer, view, direct in sends:
        by_peer.setdefault(peer, []).append((view, direct))
    for peer, items in by_peer.items():
        rank = _local(group, peer)
        for v, direct in items:
            if direct:  # a view strided in the source shard (or a caller's strided array): one copy
                ops.append(P2POp("send", wire(np.ascontiguousarray(v).reshape(-1)), rank))
        packed = [v for v, direct in items if not direct]
        if len(packed) == 1 and packed[0].flags.c_contiguous:
            message = wire(packed[0].reshape(-1))
        else:
            message = np.empty(sum(v.nbytes for v in packed), np.uint8)
            offset = 0
            for v in packed:
                message[offset : offset + v.nbytes].view(v.dtype).reshape(v.shape)[...] = v
                offset += v.nbytes
        if message.nbytes:
            ops.append(P2POp("send", message, rank))
    works = group.batch_isend_irecv(ops)
    for target, source in copies:
        target[...] = source
    for work in works:
        work.wait()
    for message, targets in unpacks:
        offset = 0
        for target, dtype in targets:
            n = target.size * dtype.itemsize
            target[...] = message[offset : offset + n].view(dtype).reshape(target.shape)  # cast on arrival
            offset += n


def _receive(targets: list, rank: int, unpacks: list):
    """The receive of one message holding `targets` (views, each with its dtype on the wire) in
    order: straight into the target when it is one C-contiguous view of that dtype, else into a
    buffer unpacked after the wait."""
    from ms_layout.comm import P2POp

    target, dtype = targets[0]
    if len(targets) == 1 and target.dtype == dtype and target.flags.c_contiguous:
        return P2POp("recv", wire(target.reshape(-1)), rank)
    message = np.empty(sum(t.size * d.itemsize for t, d in targets), np.uint8)
    unpacks.append((message, targets))
    return P2POp("recv", message, rank)
