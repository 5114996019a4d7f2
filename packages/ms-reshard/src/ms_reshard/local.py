"""Running a plan on numpy arrays in one process: `apply_local(plan, shards)`.

It replays every rank's op list (``TensorPlan.ops_by_rank``) round by round with an in-memory
mailbox, using the same pack/unpack helpers as the online executor, so a test of apply_local is a
test of the op lists every live rank would run. Offline tools use it to rebuild target shards.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .errors import ReshardError
from .plan import Box, OpKind, TensorPlan


def local_slices(box: Box, origin: tuple[int, ...]) -> tuple:
    """The slices of a global box inside a shard whose first element sits at global `origin`
    (ending in ``...`` so that indexing a 0-d shard gives a view, not a scalar)."""
    return (*(slice(a - o, b - o) for (a, b), o in zip(box, origin)), Ellipsis)


def origin(plan: TensorPlan, side: str, rank: int) -> tuple[int, ...]:
    """Global index of the first element of `rank`'s shard on the "src" or "dst" side."""
    layout = plan.src if side == "src" else plan.dst
    return tuple(s.start for s in layout.global_slice(plan.shape, rank))


def pack(shard: np.ndarray, box: Box, at: tuple[int, ...]) -> np.ndarray:
    """A contiguous copy of `box` out of a shard (the buffer that goes on the wire)."""
    return np.ascontiguousarray(shard[local_slices(box, at)]).reshape(-1)


def unpack(out: np.ndarray, box: Box, at: tuple[int, ...], flat: np.ndarray) -> None:
    """Write a received flat buffer into `box` of a target shard."""
    view = out[local_slices(box, at)]
    view[...] = flat.reshape(view.shape)


def check_shards(plan: TensorPlan, shards: Mapping[int, np.ndarray]) -> np.dtype:
    """Every given rank is a source rank with a shard of the right shape; one dtype for all."""
    want = plan.src.shard_shape(plan.shape)
    src_ranks = set(plan.src.ranks)
    dtypes = set()
    for rank, array in shards.items():
        if rank not in src_ranks:
            raise ReshardError(f"shard given for rank {rank!r}, which is not in the source layout's ranks")
        shape = tuple(np.shape(array))
        if shape != want:
            raise ReshardError(f"shard of rank {rank} has shape {shape}; the source layout gives {want}")
        dtypes.add(np.asarray(array).dtype)
    if len(dtypes) > 1:
        raise ReshardError(f"shards have mixed dtypes {sorted(map(str, dtypes))}")
    if not dtypes:
        raise ReshardError("apply_local got no shards")
    return dtypes.pop()


def needed_ranks(plan: TensorPlan) -> set[int]:
    """Source ranks whose shards the plan reads (copies, senders, collective members)."""
    ids = set(plan.copy_id.tolist()) | set(plan.xfer_src.tolist())
    if plan.multicast is not None:
        ids.update(plan.multicast.src.tolist())
    for col in plan.collectives:
        ids.update(col.members)
    return {int(plan.ranks[i]) for i in ids}


def apply_local(plan: TensorPlan, shards: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Run `plan` on {source rank: shard}; returns {target rank: shard}.

    Only the ranks the plan reads from must be given (any replica set the planner chose)."""
    dtype = check_shards(plan, shards)
    missing = sorted(needed_ranks(plan) - set(shards))
    if missing:
        raise ReshardError(f"the plan reads the shards of ranks {missing}, which were not given")
    out = {r: np.empty(plan.dst.shard_shape(plan.shape), dtype=dtype) for r in plan.dst.ranks}
    src_at = {r: origin(plan, "src", r) for r in shards}
    dst_at = {r: origin(plan, "dst", r) for r in out}
    ops = plan.ops_by_rank()
    for rnd in range(plan.rounds):
        mail: dict[tuple[OpKind, int], object] = {}
        # Pass 1: every rank does its local work and puts what it sends on the wire.
        for rank, rank_ops in ops.items():
            for op in (o for o in rank_ops if o.round == rnd):
                if op.kind is OpKind.COPY:
                    unpack(out[rank], op.box, dst_at[rank], pack(shards[rank], op.box, src_at[rank]))
                elif op.kind is OpKind.SEND:
                    mail[(op.kind, op.index)] = pack(shards[rank], op.box, src_at[rank])
                elif op.kind is not OpKind.RECV:
                    mail[(op.kind, op.index, rank)] = contribution(plan, op.index, rank, shards[rank], src_at[rank])
        # Pass 2: every rank takes what was sent to it.
        for rank, rank_ops in ops.items():
            for op in (o for o in rank_ops if o.round == rnd):
                if op.kind is OpKind.RECV:
                    unpack(out[rank], op.box, dst_at[rank], mail[(OpKind.SEND, op.index)])
                elif op.kind in (OpKind.ALL_GATHER, OpKind.ALL_TO_ALL):
                    _collect(plan, op.index, rank, mail, out[rank], dst_at[rank])
    return out


def contribution(plan: TensorPlan, index: int, rank: int, shard: np.ndarray, at: tuple[int, ...]) -> np.ndarray:
    """The flat input buffer a member gives a collective (all-gather: its piece; all-to-all: its
    pieces for every member in group order, the diagonal left as an uninitialised placeholder)."""
    col = plan.collectives[index]
    i = col.members.index(plan.rank_id(rank))
    if col.kind is OpKind.ALL_GATHER:
        return pack(shard, _tup(col.boxes[i]), at)
    buf = np.empty(len(col.members) * col.elems, dtype=shard.dtype)
    for j in range(len(col.members)):
        if j != i:
            buf[j * col.elems : (j + 1) * col.elems] = pack(shard, _tup(col.boxes[i, j]), at)
    return buf


def place_result(plan: TensorPlan, index: int, rank: int, result: np.ndarray, out: np.ndarray, at) -> None:
    """Write a collective's flat output ([k * elems], group order) into this member's target shard."""
    col = plan.collectives[index]
    i = col.members.index(plan.rank_id(rank))
    for j in range(len(col.members)):
        if j != i:
            box = col.boxes[j] if col.kind is OpKind.ALL_GATHER else col.boxes[j, i]
            unpack(out, _tup(box), at, result[j * col.elems : (j + 1) * col.elems])


def _collect(plan: TensorPlan, index: int, rank: int, mail: dict, out: np.ndarray, at) -> None:
    # Simulate the collective: member j's share of the output comes from member j's contribution.
    col = plan.collectives[index]
    i = col.members.index(plan.rank_id(rank))
    parts = []
    for m in col.members:
        buf = mail[(col.kind, index, int(plan.ranks[m]))]
        parts.append(buf if col.kind is OpKind.ALL_GATHER else buf[i * col.elems : (i + 1) * col.elems])
    place_result(plan, index, rank, np.concatenate(parts), out, at)


def _tup(box: np.ndarray) -> Box:
    return tuple((int(a), int(b)) for a, b in box)


def _along(dim: int, start: int, size: int) -> tuple:
    return (slice(None),) * dim + (slice(start, start + size), Ellipsis)


def apply_model_local(model_plan, shards: Mapping[str, Mapping[int, np.ndarray]]) -> dict[str, dict[int, np.ndarray]]:
    """Run a ModelPlan on {source name: {rank: shard}}; returns {target name: {rank: shard}}.

    A part of a fused parameter is read from (and written to) its offset inside the fused shard;
    values are cast to the target's dtype when numpy knows it."""
    out: dict[str, dict[int, np.ndarray]] = {}
    for move in model_plan.moves:
        p = move.plan
        if move.src_name not in shards:
            raise ReshardError(f"no shards given for source parameter {move.src_name!r}")
        n_src = p.src.shard_shape(p.shape)[move.dim] if p.shape else 0
        part = {r: np.asarray(a)[_along(move.dim, move.src_offset, n_src)] if p.shape else a
                for r, a in shards[move.src_name].items()}  # fmt: skip
        result = apply_local(p, part)
        spec = model_plan.dst[move.dst_name]
        if move.dst_name not in out:
            dtype = _numpy_dtype(spec.dtype, next(iter(result.values())).dtype) if result else np.float32
            local = spec.layout.shard_shape(spec.shape)
            out[move.dst_name] = {r: np.empty(local, dtype=dtype) for r in spec.layout.ranks}
        n_dst = p.dst.shard_shape(p.shape)[move.dim] if p.shape else 0
        for r, a in result.items():
            target = out[move.dst_name][r]
            if p.shape:
                target[_along(move.dim, move.dst_offset, n_dst)] = a
            else:
                target[...] = a
    return out


def _numpy_dtype(name: str, fallback: np.dtype) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        return fallback
