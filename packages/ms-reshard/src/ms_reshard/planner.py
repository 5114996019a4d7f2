"""The box planner: from any layout to any layout, by intersecting target boxes with source boxes.

This is the tile-intersection formulation of Alpa's cross-mesh resharding (Zhuang et al., MLSys'23,
docs/rlhf-reshard-prior-art.md §3): it needs no common device matrix, so meshes that do
not factor into each other (2x3 vs 3x2), different rank counts and disjoint rank sets are all the
same case. For every target rank:

1. its target box is cut along each dim by the source chunk boundaries into pieces;
2. a piece whose source chunk the rank already holds is a local copy;
3. every other piece comes from one of the ranks holding that chunk: the receivers of a chunk,
   in rank order, are dealt out in contiguous blocks of equal bytes to its holders in rank order
   (balances senders, and neighbouring ranks -- usually one node -- pair up);
4. transfer groups that form a complete exchange of equal pieces become an all-gather or an
   all-to-all (collectives.py), and a memory cap splits the rest into rounds (rounds.py).

When the target replicates so much that the transfers would outnumber `multicast_min` (and
multicasts save at least half the rows), step 3 instead gives each piece one multicast row per
sender: the replicas of the target chunk, in rank order, are split into equal blocks, one per
holder of the source chunk in rank order (multicast.py). Planning then costs pieces x senders
rather than receivers x pieces, which is what keeps DeepSeek-V3 at 4096 ranks to seconds.

Each rank receives exactly the part of its target shard it does not hold: the lower bound.
Everything is vectorized over ranks and pieces, so one plan costs the same for 8 or 4096 ranks up
to numpy's per-element work.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from ms_layout import Layout, LayoutError

from .collectives import find_collectives
from .errors import ReshardError
from .limits import check_layout, check_shape
from .multicast import Multicast
from .plan import TensorPlan, box_elems
from .rounds import assign_rounds

MULTICAST_MIN = 1 << 14
"""Transfers from which a plan uses multicast rows (a few thousand rows cost nothing either way)."""


def plan(
    src: Layout,
    dst: Layout,
    global_shape: Sequence[int],
    itemsize: int = 4,
    mem_cap: int | None = None,
    collectives: bool = True,
    multicast_min: int | None = MULTICAST_MIN,
) -> TensorPlan:
    """Plan moving a tensor of `global_shape` from layout `src` to layout `dst`.

    `itemsize` only scales the byte counts; `mem_cap` bounds the bytes of send/receive buffers a
    rank holds in one round; `collectives=False` keeps every transfer point-to-point;
    `multicast_min` (None: never; 0: always) is the number of transfers from which a
    plan without a memory cap uses multicast rows instead.
    """
    shape = _check_inputs(src, dst, global_shape, itemsize, mem_cap)
    ranks = np.union1d(np.asarray(src.ranks, dtype=np.int64), np.asarray(dst.ranks, dtype=np.int64))
    src_ids = np.searchsorted(ranks, np.asarray(src.ranks, dtype=np.int64))
    dst_ids = np.searchsorted(ranks, np.asarray(dst.ranks, dtype=np.int64))
    return plan_ids(src, dst, shape, src_ids, dst_ids, ranks, itemsize, mem_cap, collectives, multicast_min)


def _check_inputs(
    src: Layout, dst: Layout, global_shape: Sequence[int], itemsize: int, mem_cap: int | None
) -> tuple[int, ...]:
    for side, layout in (("src", src), ("dst", dst)):
        if not isinstance(layout, Layout) or layout.dims is None:
            raise ReshardError(f"{side} must be an ms_layout.Layout with a tensor map, got {layout!r:.120}")
    try:
        shape = tuple(int(s) for s in global_shape)
    except (TypeError, ValueError, OverflowError):
        raise ReshardError(f"global shape {global_shape!r} must be a sequence of ints") from None
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize <= 0:
        raise ReshardError(f"itemsize={itemsize!r} must be a positive int")
    # Sizes from input: the plan's arrays are per rank and its byte counts are int64.
    check_shape(shape, itemsize, "global shape")
    for side, layout in (("src", src), ("dst", dst)):
        check_layout(layout, f"{side} layout")
        try:
            layout.shard_shape(shape)
        except LayoutError as exc:
            raise ReshardError(f"{side} layout {layout} cannot hold global shape {shape}: {exc}") from None
    if mem_cap is not None and (not isinstance(mem_cap, int) or mem_cap < itemsize):
        raise ReshardError(f"mem_cap={mem_cap!r} must be None or an int of at least one element ({itemsize} B)")
    return shape


def chunk_indices(layout: Layout) -> np.ndarray:
    """[positions, ndim]: the chunk index of every device-matrix position along every tensor dim
    (read-only: one array per mesh and tensor map, shared by every plan that asks)."""
    layout.ndim  # noqa: B018 - raises the LayoutError for a layout without a tensor map
    return _chunk_indices(layout.device_matrix, layout.alias_names, layout.dims)


@functools.lru_cache(maxsize=1024)
def _chunk_indices(sizes: tuple[int, ...], names: tuple[str, ...], dims: tuple[tuple[str, ...], ...]) -> np.ndarray:
    count = math.prod(sizes)
    coords = np.unravel_index(np.arange(count), sizes)
    out = np.zeros((count, len(dims)), dtype=np.int64)
    for d, axes in enumerate(dims):
        for axis in axes:  # first-named axis is the most significant digit (MindSpore's order)
            a = names.index(axis)
            out[:, d] = out[:, d] * sizes[a] + coords[a]
    out.setflags(write=False)
    return out


def _dim_pieces(size: int, src_parts: int, dst_parts: int) -> tuple[np.ndarray, ...]:
    """Along one dim: for each target chunk j and slot m, the source chunk, start and stop of the
    piece (slots past the last piece are marked invalid). Arrays are [dst_parts, slots]."""
    a, b = size // src_parts, size // dst_parts
    lo = np.arange(dst_parts, dtype=np.int64) * b
    k0, k1 = lo // a, (lo + b - 1) // a
    slots = int((k1 - k0).max()) + 1
    k = k0[:, None] + np.arange(slots, dtype=np.int64)[None, :]
    valid = k <= k1[:, None]
    start = np.maximum(lo[:, None], k * a)
    stop = np.minimum(lo[:, None] + b, (k + 1) * a)
    return np.where(valid, k, 0), start, stop, valid


def _pieces(shape: tuple[int, ...], src_splits: tuple[int, ...], dst_splits: tuple[int, ...]):
    """Every piece of every target chunk: (target chunk flat id, source chunk flat id, box).

    Pieces come out grouped by target chunk in flat (row-major) order."""
    ndim = len(shape)
    tables = [_dim_pieces(shape[d], src_splits[d], dst_splits[d]) for d in range(ndim)]
    n_dst = math.prod(dst_splits)
    grid = np.indices(dst_splits).reshape(ndim, -1).T if ndim else np.zeros((1, 0), dtype=np.int64)
    slots = tuple(t[0].shape[1] for t in tables)
    combos = np.indices(slots).reshape(ndim, -1).T if ndim else np.zeros((1, 0), dtype=np.int64)
    valid = np.ones((n_dst, len(combos)), dtype=bool)
    src_flat = np.zeros((n_dst, len(combos)), dtype=np.int64)
    box = np.zeros((n_dst, len(combos), ndim, 2), dtype=np.int64)
    for d, (k, start, stop, ok) in enumerate(tables):
        j, m = grid[:, d][:, None], combos[:, d][None, :]
        valid &= ok[j, m]
        src_flat = src_flat * src_splits[d] + k[j, m]
        box[:, :, d, 0], box[:, :, d, 1] = start[j, m], stop[j, m]
    dst_flat = np.broadcast_to(np.arange(n_dst, dtype=np.int64)[:, None], valid.shape)
    return dst_flat[valid], src_flat[valid], box[valid]


def plan_ids(
    src: Layout,
    dst: Layout,
    shape: tuple[int, ...],
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    ranks: np.ndarray,
    itemsize: int,
    mem_cap: int | None,
    collectives: bool,
    multicast_min: int | None = MULTICAST_MIN,
) -> TensorPlan:
    """The planner proper, on ids (positions in `ranks`) instead of global ranks."""
    ndim, n_ids = len(shape), len(ranks)
    empty_box = np.zeros((0, ndim, 2), dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    if math.prod(shape) == 0:
        zeros = np.zeros(n_ids, dtype=np.int64)
        return TensorPlan(
            src, dst, shape, itemsize, mem_cap, ranks, empty, empty_box, empty, empty, empty, empty_box, (),
            zeros, zeros, zeros, 1,
        )  # fmt: skip
    src_splits, dst_splits = src.splits, dst.splits
    src_chunk = _flat(chunk_indices(src), src_splits)
    dst_chunk = _flat(chunk_indices(dst), dst_splits)
    # Holders of each source chunk, ids ascending: [chunks, replicas]
    order = np.lexsort((src_ids, src_chunk))
    holders = src_ids[order].reshape(math.prod(src_splits), -1)
    held_chunk = np.full(n_ids, -1, dtype=np.int64)
    held_chunk[src_ids] = src_chunk

    p_dst, p_src, p_box = _pieces(shape, src_splits, dst_splits)
    if multicast_min is not None and mem_cap is None:
        pieces = (p_dst, p_src, p_box)
        found = _multicast_plan(src, dst, shape, src_ids, dst_ids, ranks, itemsize, pieces, holders, multicast_min)
        if found is not None and not (collectives and multicast_min and _all_gathers(found.multicast)):
            return found
    counts = np.bincount(p_dst, minlength=math.prod(dst_splits))
    starts = np.cumsum(counts) - counts
    # Expand pieces to every target rank holding that chunk: one row per (receiver, piece)
    n_per = counts[dst_chunk]
    recv = np.repeat(dst_ids, n_per)
    first = np.repeat(starts[dst_chunk], n_per)
    piece = first + np.arange(len(recv)) - np.repeat(np.cumsum(n_per) - n_per, n_per)
    # Work on piece indices and gather the [rows, ndim, 2] boxes once, at the end (the big copy).
    p_elems = box_elems(p_box)
    chunk = p_src[piece]
    local = held_chunk[recv] == chunk
    copy_id, copy_box = recv[local], p_box[piece[local]]
    remote = ~local
    recv, chunk, piece = recv[remote], chunk[remote], piece[remote]
    # Transfers stay in receiver order: any fixed order works, both ends of a message follow it.
    sender = _choose_senders(recv, chunk, p_elems[piece], holders)
    boxes = p_box[piece]

    found = find_collectives(sender, recv, boxes, n_ids, p_elems[piece]) if collectives else []
    keep = np.ones(len(sender), dtype=bool)
    for _, rows in found:
        keep[rows] = False
    cols = [c for c, _ in found]
    xfer_round, cols, (sender, recv, boxes), notes = assign_rounds(
        cols, sender[keep], recv[keep], boxes[keep], itemsize, mem_cap, n_ids
    )
    sent, received = _traffic(sender, recv, box_elems(boxes), cols, n_ids, itemsize)
    lower = _lower_bound(src, dst, shape, src_ids, dst_ids, n_ids, itemsize)
    rounds = int(max(xfer_round.max(initial=0), max((c.round for c in cols), default=0))) + 1
    return TensorPlan(
        src, dst, shape, itemsize, mem_cap, ranks, copy_id, copy_box, sender, recv, xfer_round, boxes,
        tuple(cols), sent, received, lower, rounds, tuple(notes),
    )  # fmt: skip


def _multicast_plan(src, dst, shape, src_ids, dst_ids, ranks, itemsize, pieces, holders, multicast_min):
    """The plan with multicast rows (module docstring), or None when point-to-point is as small."""
    p_dst, p_src, p_box = pieces
    n_ids, n_src = len(ranks), math.prod(src.splits)
    dst_chunk = _flat(chunk_indices(dst), dst.splits)
    replicas = np.bincount(dst_chunk, minlength=math.prod(dst.splits))
    n_recv = replicas[p_dst]  # receivers of each piece, before its holders among them copy instead
    blocks = np.minimum(holders.shape[1], n_recv)
    if n_recv.sum() < multicast_min or (multicast_min and n_recv.sum() < 2 * blocks.sum()):
        return None  # (multicast_min=0 forces multicasts, which the tests use)
    chunk_of = np.full(n_ids, -1, dtype=np.int64)
    chunk_of[dst_ids] = dst_chunk
    held = np.full(n_ids, -1, dtype=np.int64)
    held[src_ids] = _flat(chunk_indices(src), src.splits)
    # Position of every target id among the replicas of its chunk (ids ascending)
    order = np.lexsort((dst_ids, dst_chunk))
    pos = np.zeros(n_ids, dtype=np.int64)
    pos[dst_ids[order]] = np.arange(len(order)) - (np.cumsum(replicas) - replicas)[dst_chunk[order]]
    # Local copies: a target id that holds one of its chunk's source chunks. Pieces are unique per
    # (target chunk, source chunk), so a sorted key finds each id's piece.
    key = p_dst * n_src + p_src
    by_key = np.argsort(key, kind="stable")
    ids = dst_ids[held[dst_ids] >= 0]
    want = chunk_of[ids] * n_src + held[ids]
    at = np.minimum(np.searchsorted(key[by_key], want), len(key) - 1)
    hit = key[by_key[at]] == want
    copy_id, copy_piece = ids[hit], by_key[at[hit]]
    # Rows: piece p's receivers split into blocks[p] equal position ranges, block b sent by holder b
    piece = np.repeat(np.arange(len(p_dst)), blocks)
    b = np.arange(len(piece)) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    n, k = n_recv[piece], blocks[piece]
    lo, hi = b * n // k, (b + 1) * n // k
    sender = holders[p_src[piece], b]
    # Receivers a row really has: its range less the ids in it that copy the piece instead
    width = int(replicas.max()) + 1
    copies = np.sort(copy_piece * width + pos[copy_id])
    count = hi - lo - (np.searchsorted(copies, piece * width + hi) - np.searchsorted(copies, piece * width + lo))
    keep = count > 0
    piece, sender, lo, hi, count = piece[keep], sender[keep], lo[keep], hi[keep], count[keep]
    p_elems = box_elems(p_box)
    sent = np.bincount(sender, weights=count * p_elems[piece], minlength=n_ids).astype(np.int64) * itemsize
    shard = math.prod(dst.shard_shape(shape))
    copied = np.bincount(copy_id, weights=p_elems[copy_piece], minlength=n_ids).astype(np.int64)
    received = np.zeros(n_ids, dtype=np.int64)
    received[dst_ids] = shard - copied[dst_ids]
    mc = Multicast(sender, p_box[piece], p_dst[piece], p_src[piece], lo, hi, chunk_of, held)
    empty = np.zeros(0, dtype=np.int64)
    return TensorPlan(
        src, dst, shape, itemsize, None, ranks, copy_id, p_box[copy_piece], empty, empty, empty,
        np.zeros((0, len(shape), 2), dtype=np.int64), (), sent, received * itemsize,
        _lower_bound(src, dst, shape, src_ids, dst_ids, n_ids, itemsize), 1, (), mc,
    )  # fmt: skip


def _all_gathers(mc: Multicast) -> bool:
    """Whether the multicast rows are exactly all-gathers, one per target chunk: every replica of
    the chunk sends one equal piece to all the others. Such a plan stays point-to-point, where step 4
    turns it into all-gather collectives (same bytes; a collective backend runs them faster)."""
    chunks, replicas = np.unique(mc.dst_chunk[mc.dst_chunk >= 0], return_counts=True)
    n = np.zeros(int(chunks.max(initial=-1)) + 1, dtype=np.int64)
    n[chunks] = replicas
    j = mc.target_chunk
    if not len(j) or (mc.lo != 0).any() or (mc.hi != n[j]).any() or (mc.dst_chunk[mc.src] != j).any():
        return False
    elems = box_elems(mc.box)
    first = np.full(len(n), -1, dtype=np.int64)
    first[j] = elems
    rows = np.bincount(j, minlength=len(n))
    return bool((elems == first[j]).all() and (rows[chunks] == replicas).all())


def _flat(index: np.ndarray, splits: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(len(index), dtype=np.int64)
    for d, n in enumerate(splits):
        out = out * n + index[:, d]
    return out


def _choose_senders(recv: np.ndarray, chunk: np.ndarray, elems: np.ndarray, holders: np.ndarray) -> np.ndarray:
    """For each (receiver, chunk) piece, the holder that sends it.

    The receivers of one chunk, in id order, are split into as many contiguous blocks of equal bytes
    as the chunk has holders, and block i goes to holder i (ids ascending): every holder sends the
    same share, and low ranks are served by low ranks. Ids preserve rank order, so the choice is the
    same under any order-preserving relabeling of the ranks (which is what lets plans be reused)."""
    if len(recv) == 0:
        return recv.copy()
    n_chunks, replicas = holders.shape
    if replicas == 1:  # one holder per chunk (e.g. an optimizer-sharded source): nothing to choose
        return holders[chunk, 0]
    # Group rows by chunk, receivers in id order inside a group: rows come sorted by receiver, so
    # one stable sort on the chunk does it (a radix sort when the chunk ids fit 16 bits).
    if (np.diff(recv) >= 0).all():
        key = chunk.astype(np.uint16) if n_chunks < 1 << 16 else chunk
        order = np.argsort(key, kind="stable")
    else:
        order = np.lexsort((recv, chunk))
    c, e = chunk[order], elems[order]
    counts = np.bincount(c, minlength=n_chunks)
    starts = np.cumsum(counts) - counts
    if (e == e[0]).all():  # equal pieces: the block is the receiver's position in its group
        before, total = np.arange(len(c)) - starts[c], counts[c]
    else:
        cum = np.cumsum(e) - e  # bytes before each row
        base = cum[np.minimum(starts, len(c) - 1)]
        before = cum - base[c]
        total = np.bincount(c, weights=e, minlength=n_chunks).astype(np.int64)[c]
    slot = np.minimum(before * replicas // total, replicas - 1)
    out = np.empty_like(recv)
    out[order] = holders[c, slot]
    return out


def _traffic(sender, recv, elems, cols, n_ids: int, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    """Bytes each id sends and receives, point-to-point and in collectives."""
    sent = np.bincount(sender, weights=elems, minlength=n_ids).astype(np.int64)
    received = np.bincount(recv, weights=elems, minlength=n_ids).astype(np.int64)
    for col in cols:
        members = np.asarray(col.members)
        k = len(members)
        # k-1 pieces go out and k-1 come in, in both kinds (the diagonal of an all-to-all stays local)
        sent[members] += (k - 1) * col.elems
        received[members] += (k - 1) * col.elems
    return sent * itemsize, received * itemsize


def _lower_bound(src, dst, shape, src_ids, dst_ids, n_ids: int, itemsize: int) -> np.ndarray:
    """Per id: elements of its target box outside its own source box (computed from the boxes
    directly, independently of the pieces, so it checks the planner rather than repeating it)."""
    src_shard = np.asarray(src.shard_shape(shape), dtype=np.int64)
    dst_shard = np.asarray(dst.shard_shape(shape), dtype=np.int64)
    in_src = np.zeros(n_ids, dtype=bool)
    in_src[src_ids] = True
    src_lo = np.zeros((n_ids, len(shape)), dtype=np.int64)
    src_lo[src_ids] = chunk_indices(src) * src_shard
    dst_lo = chunk_indices(dst) * dst_shard
    s_lo = src_lo[dst_ids]
    overlap = np.clip(np.minimum(dst_lo + dst_shard, s_lo + src_shard) - np.maximum(dst_lo, s_lo), 0, None)
    held = np.where(in_src[dst_ids], np.prod(overlap, axis=1), 0)
    out = np.zeros(n_ids, dtype=np.int64)
    out[dst_ids] = int(np.prod(dst_shard)) - held
    return out * itemsize
