"""Running one rank's part of a plan over a process group (ms_layout.comm), on numpy buffers.

Every rank of the plan calls ``run_plan`` with the same plan; each walks its own op list
(``TensorPlan.rank_ops``) round by round: local copies, then its collectives in the plan's global
order, then all its sends and receives of the round as one ``batch_isend_irecv``. Because every
rank meets the collectives in the same order and a round's messages only need peers that finished
the previous rounds, the schedule cannot deadlock. Nothing here imports torch or MindSpore: the
group is any object following ``ms_layout.comm.ProcessGroup``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .errors import ReshardError
from .local import contribution, local_slices, pack, place_result, unpack
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
            batch: list = []
            recvs: list = []
            for job in bucket:
                _round(job, rnd, me, batch, recvs, subgroups, collectives)
            _exchange(group, batch)
            for out, at, box, buf in recvs:
                unpack(out, box, at, buf)


def _job(plan: TensorPlan, src, out, dtype, me: int) -> dict:
    in_src, in_dst = me in plan.src.ranks, me in plan.dst.ranks
    if (src is None) == in_src or (out is None) == in_dst:
        raise ReshardError(f"rank {me}: src given={src is not None}, out given={out is not None}; the plan says "
                           f"{in_src=} {in_dst=}")  # fmt: skip
    return {
        "plan": plan,
        "src": src,
        "out": out,
        "ops": plan.rank_ops(me),
        "src_at": tuple(s.start for s in plan.src.global_slice(plan.shape, me)) if in_src else (),
        "dst_at": tuple(s.start for s in plan.dst.global_slice(plan.shape, me)) if in_dst else (),
        "dtype": np.dtype(dtype) if dtype is not None else (src.dtype if src is not None else out.dtype),
    }


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


def _round(job: dict, rnd: int, me: int, batch: list, recvs: list, subgroups: dict, collectives: bool) -> None:
    """One plan's ops of one round: copies and collectives now, messages into the shared batch."""
    plan, src, out, src_at, dst_at = job["plan"], job["src"], job["out"], job["src_at"], job["dst_at"]
    before = len(recvs)
    for op in (o for o in job["ops"] if o.round == rnd):
        if op.kind is OpKind.COPY:
            out[local_slices(op.box, dst_at)] = src[local_slices(op.box, src_at)]
        elif op.kind is OpKind.SEND:
            batch.append(("send", wire(pack(src, op.box, src_at)), op.peer))
        elif op.kind is OpKind.RECV:
            buf = np.empty(_elems(op.box), dtype=job["dtype"])
            batch.append(("recv", wire(buf), op.peer))
            recvs.append((op.box, buf))
        elif collectives and op.group in subgroups:
            _collective(plan, op.index, me, subgroups[op.group], src, src_at, out, dst_at)
        else:
            batch += _as_p2p(plan, op.index, me, src, src_at, recvs, out)
    recvs[before:] = [(out, dst_at, box, buf) for box, buf in recvs[before:]]


def _elems(box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def _collective(plan, index, me, sub, src, src_at, out, dst_at) -> None:
    col = plan.collectives[index]
    buf = contribution(plan, index, me, src, src_at)
    if col.kind is OpKind.ALL_GATHER:
        result = sub.all_gather(wire(buf), axis=0)
    else:
        result = sub.all_to_all(wire(buf), split_axis=0, concat_axis=0)
    place_result(plan, index, me, result.view(buf.dtype), out, dst_at)


def _as_p2p(plan, index, me, src, src_at, recvs, out) -> list:
    """A collective's transfers for this rank, as point-to-point entries of the round's batch."""
    col = plan.collectives[index]
    i = col.members.index(plan.rank_id(me))
    entries = []
    for j, m in enumerate(col.members):
        if j == i:
            continue
        peer = int(plan.ranks[m])
        mine = col.boxes[i] if col.kind is OpKind.ALL_GATHER else col.boxes[i, j]
        theirs = col.boxes[j] if col.kind is OpKind.ALL_GATHER else col.boxes[j, i]
        entries.append(("send", wire(pack(src, tuple(map(tuple, mine.tolist())), src_at)), peer))
        buf = np.empty(col.elems, dtype=src.dtype)
        entries.append(("recv", wire(buf), peer))
        recvs.append((tuple(map(tuple, theirs.tolist())), buf))
    return entries


def _exchange(group, batch: list) -> None:
    """Send and receive a round's buffers with one message per peer and direction.

    Both ends list the buffers between them in the same order (the plan's), so the sender can
    concatenate its buffers for a peer as raw bytes and the receiver cut the message back into its
    buffers: a round costs at most one message per pair however many pieces it moves."""
    if not batch:
        return
    from ms_layout.comm import P2POp

    sends: dict[int, list[np.ndarray]] = {}
    recvs: dict[int, list[np.ndarray]] = {}
    for kind, buf, peer in batch:
        (sends if kind == "send" else recvs).setdefault(peer, []).append(buf)
    ops, merged = [], []
    for peer, bufs in sends.items():
        message = bufs[0] if len(bufs) == 1 else np.concatenate([_bytes(b) for b in bufs])
        if message.nbytes:
            ops.append(P2POp("send", message, _local(group, peer)))
    for peer, bufs in recvs.items():
        message = bufs[0] if len(bufs) == 1 else np.empty(sum(b.nbytes for b in bufs), np.uint8)
        if message.nbytes:
            ops.append(P2POp("recv", message, _local(group, peer)))
            if len(bufs) > 1:
                merged.append((message, bufs))
    for work in group.batch_isend_irecv(ops):
        work.wait()
    for message, bufs in merged:
        offset = 0
        for b in bufs:
            _bytes(b)[...] = message[offset : offset + b.nbytes]
            offset += b.nbytes


def _bytes(buf: np.ndarray) -> np.ndarray:
    return buf.reshape(-1).view(np.uint8)
