"""Paged KV cache: vLLM-style block tables and slot mappings, in MindSpore tensors.

A cache tensor is [num_blocks, block_size, ...]; token j of a sequence lives in block
`block_table[j // block_size]` at offset `j % block_size`, i.e. flat slot
`block * block_size + offset`. One forward call takes a flat batch of T new tokens from N
sequences (prefill chunks and single decode tokens mixed, vLLM's `query_start_loc` layout) and:

1. writes each token's key/value (or MLA latent) at its `slot_mapping` entry (-1: padding, skipped);
2. gathers every sequence's context (its first `seq_lens[s]` tokens) through its block table;
3. lets token t attend to context positions <= positions[t].

The index bookkeeping is the same for every layer, so it is done once per call in numpy
(`PagedMetadata.build`). The caches are Parameters (`allocate_kv_caches`), written functionally
with `ops.scatter_nd_update`: that updates the Parameter in PyNative and, unlike index
assignment on a plain tensor, also inside a `mindspore.jit` graph, so the same `forward_paged`
runs eagerly or compiled (docs/mindspore-cpu.md §12). Plain tensors are still accepted and
written by index assignment (PyNative only; in-place arithmetic such as `add_` would silently do
nothing, §10.3).

Compiled callers need fixed shapes: `build(..., query_len=Q, context_len=C)` pads the per-sequence
query and context axes, and a caller pads the token and sequence axes itself (padding tokens with a
slot in a scratch block, padding sequences with an empty query), so one graph serves every batch
of its bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mindspore import Parameter, Tensor, ops
from mindspore import dtype as mstype

from .errors import ModelError


def _np(x, dtype=np.int64) -> np.ndarray:
    if isinstance(x, Tensor):
        x = x.asnumpy()
    return np.asarray(x, dtype=dtype)


@dataclass
class PagedMetadata:
    """Index tensors shared by all layers of one paged forward call."""

    block_size: int
    """Tokens per cache block."""
    write_index: Tensor
    """[W, 2] (block, offset) of each token written (tokens with slot -1 are left out)."""
    write_rows: Tensor
    """[W] row in the flat token batch of each token written."""
    context_slots: Tensor
    """[N, C] flat cache slot of context position j of sequence s (0 past the sequence's end)."""
    query_rows: Tensor
    """[N, Q] flat-batch row of query i of sequence s (0 for padding), Q = longest query."""
    padded_rows: Tensor
    """[T] index into the flattened [N * Q] padded queries of each flat-batch token."""
    allowed: Tensor
    """[N, 1, Q, C] bool: query i of sequence s may attend context position j."""
    write_slots: Tensor
    """[W] flat slot (block * block_size + offset) of each token written."""

    def tensors(self) -> tuple[Tensor, ...]:
        """The index tensors in PAGED_TENSORS order (the inputs of a compiled step)."""
        return tuple(getattr(self, name) for name in PAGED_TENSORS)

    @classmethod
    def build(
        cls,
        positions,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        block_size: int,
        query_len: int | None = None,
        context_len: int | None = None,
    ) -> PagedMetadata:
        """Check the vLLM-style inputs and derive the index tensors; `query_len` / `context_len` pad
        the Q and C axes to a fixed size (at least the longest query / context)."""
        positions, slots = _np(positions), _np(slot_mapping)
        tables, lens, starts = _np(block_tables), _np(seq_lens), _np(query_start_loc)
        t, n = positions.shape[0], lens.shape[0]
        if tables.ndim != 2 or tables.shape[0] != n or starts.shape != (n + 1,):
            raise ModelError(
                f"block_tables {tables.shape}, seq_lens {lens.shape}, query_start_loc {starts.shape} disagree: "
                "expected [N, max_blocks], [N], [N + 1]"
            )
        if slots.shape != (t,) or starts[0] != 0 or starts[-1] > t or np.any(np.diff(starts) < 0):
            raise ModelError(
                f"slot_mapping {slots.shape} / query_start_loc {starts.tolist()} do not describe {t} tokens"
            )
        q_lens = np.diff(starts)
        if np.any(q_lens > lens):
            raise ModelError(
                f"a query is longer than its sequence: query lens {q_lens.tolist()}, seq_lens {lens.tolist()}"
            )
        if np.any(lens > tables.shape[1] * block_size):
            raise ModelError(f"seq_lens {lens.tolist()} exceed block_tables capacity {tables.shape[1]} x {block_size}")
        q_max, c_max = max(int(q_lens.max(initial=1)), 1), max(int(lens.max(initial=1)), 1)
        for name, pad, need in (("query_len", query_len, q_max), ("context_len", context_len, c_max)):
            if pad is not None and pad < need:
                raise ModelError(f"{name}={pad} is shorter than the batch needs ({need})")
        q_max, c_max = query_len or q_max, context_len or c_max

        j = np.arange(c_max)
        ctx_valid = j[None, :] < lens[:, None]
        blocks = np.take_along_axis(tables, np.minimum(j // block_size, tables.shape[1] - 1)[None].repeat(n, 0), 1)
        context_slots = np.where(ctx_valid, blocks * block_size + j % block_size, 0)

        i = np.arange(q_max)
        q_valid = i[None, :] < q_lens[:, None]
        query_rows = np.where(q_valid, starts[:-1, None] + i[None, :], 0)
        q_pos = positions[np.minimum(query_rows, max(t - 1, 0))] if t else np.zeros_like(query_rows)
        allowed = q_valid[:, :, None] & ctx_valid[:, None, :] & (j[None, None, :] <= q_pos[:, :, None])

        seq_of = np.repeat(np.arange(n), q_lens)
        padded_rows = seq_of * q_max + (np.arange(len(seq_of)) - starts[seq_of])
        if len(seq_of) != t:  # trailing padding tokens (vLLM pads batches): point them at any row
            padded_rows = np.concatenate([padded_rows, np.zeros(t - len(seq_of), np.int64)])
        keep = slots >= 0
        return cls(
            block_size=block_size,
            write_index=Tensor(np.stack([slots[keep] // block_size, slots[keep] % block_size], 1).astype(np.int32)),
            write_rows=Tensor(np.nonzero(keep)[0].astype(np.int32)),
            context_slots=Tensor(context_slots.astype(np.int32)),
            query_rows=Tensor(query_rows.astype(np.int32)),
            padded_rows=Tensor(padded_rows.astype(np.int32)),
            allowed=Tensor(allowed[:, None]),
            write_slots=Tensor(slots[keep].astype(np.int32)),
        )


PAGED_TENSORS = ("write_index", "write_rows", "context_slots", "query_rows", "padded_rows", "allowed", "write_slots")
"""The tensor fields of PagedMetadata, in the order compiled callers pass them."""


def _field(meta, i: int):
    """Field PAGED_TENSORS[i] of a PagedMetadata, or of the plain tuple a compiled step passes.

    Under `mindspore.jit` only plain tensors and tuples of them stay typed: a dataclass argument is a
    compile-time constant (a new one recompiles, a mutated one is ignored), and a dataclass or
    namedtuple built inside the graph comes out untyped, so its float32 results were typed float64
    and the cache writes failed (docs/mindspore-cpu.md §12)."""
    return meta[i] if isinstance(meta, tuple) else getattr(meta, PAGED_TENSORS[i])


def allowed_mask(meta) -> Tensor:
    """[N, 1, Q, C] bool attention mask of the call."""
    return _field(meta, 5)


# Rows are taken with ops.gather, not x[index_tensor]: under jit, indexing by a tensor comes out
# untyped, and every later op of the graph with it (its float32 results were typed float64).


def write_cache(cache: Tensor, values: Tensor, meta: PagedMetadata, flat: bool = False):
    """cache[block, offset] = values[row] for every written token, in place (functionally for a
    Parameter, so that it also persists from a compiled graph). `flat`: the cache is head-major and
    slot-major, [heads * slots, ...] (see allocate_kv_caches), for values [T, heads, d] or [T, d]
    (one head: MLA's latent). Returns the write, for ops.depend."""
    write_rows = _field(meta, 1)
    if not write_rows.shape[0]:
        return cache
    rows = ops.gather(values, write_rows, 0)
    if flat:
        index = _field(meta, 6)
        if rows.ndim == 3:  # [W, heads, d] -> [heads, W, d] at rows h * slots + slot
            index = _head_index(index, rows.shape[1], cache.shape[0])
            rows = rows.transpose(1, 0, 2)
        if isinstance(cache, Parameter):
            return ops.scatter_update(cache, index, rows.astype(cache.dtype))
        cache[index] = rows.astype(cache.dtype)
        return cache
    index = _field(meta, 0)
    if isinstance(cache, Parameter):
        return ops.scatter_nd_update(cache, index, rows.astype(cache.dtype))
    cache[index[:, 0], index[:, 1]] = rows.astype(cache.dtype)
    return cache


def _head_index(slots: Tensor, heads: int, rows: int) -> Tensor:
    """[heads, *slots.shape] rows of a head-major flat cache of `rows` rows: h * (rows // heads) + slot."""
    offsets = ops.arange(0, rows, rows // heads, dtype=mstype.int32)
    return offsets.reshape((heads,) + (1,) * slots.ndim) + slots.expand_dims(0)


def gather_context(cache: Tensor, meta: PagedMetadata, flat: bool = False, heads: int = 0) -> Tensor:
    """Each sequence's cached entries in order, through its block table: [N, C, ...], or for a flat
    cache of `heads` > 0 heads [heads, N, C, d] (head-major, as attend_head_major takes them)."""
    if flat:
        if heads:
            return ops.gather(cache, _head_index(_field(meta, 2), heads, cache.shape[0]), 0)
        return ops.gather(cache, _field(meta, 2), 0)
    flat_view = cache.reshape((cache.shape[0] * cache.shape[1],) + cache.shape[2:])
    return ops.gather(flat_view, _field(meta, 2), 0)


def to_padded(x: Tensor, meta: PagedMetadata) -> Tensor:
    """Flat-batch rows [T, ...] -> [N, Q, ...] padded per sequence."""
    return ops.gather(x, _field(meta, 3), 0)


def from_padded(x: Tensor, meta: PagedMetadata) -> Tensor:
    """[N, Q, ...] -> flat-batch rows [T, ...]."""
    return ops.gather(x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), _field(meta, 4), 0)


def allocate_kv_caches(model, num_blocks: int, block_size: int, dtype=mstype.float32, flat: bool = False) -> list:
    """Zeroed caches for every attention layer of `model` (the shapes come from model.kv_cache_shapes).

    `flat=True` makes them slot-major and head-major, [heads * num_blocks * block_size, d] for a
    [blocks, block_size, heads, d] cache (row h * slots + slot), [num_blocks * block_size, d] for a
    headless one (MLA's latent). Under `mindspore.jit` on CPU a write into a [blocks, block_size, ...]
    Parameter (ScatterNdUpdate) or a read through its reshape copied the whole cache per call
    (16 MiB: +1.6 ms each), while ScatterUpdate / Gather on the first axis of a 2-D Parameter did
    not; and the head-major rows gather straight into the [heads, N, C, d] operand of a batched
    matmul, where [N, C, heads, d] needed a transposed copy of every context (docs/mindspore-cpu.md
    §12). The layers tell the layouts apart by rank."""
    if num_blocks <= 0 or block_size <= 0:
        raise ModelError(f"num_blocks={num_blocks}, block_size={block_size}; both must be positive")
    shapes = model.kv_cache_shapes(num_blocks, block_size)
    if flat:
        shapes = [flat_shapes(layer) for layer in shapes]
    return [zeros_cache(layer, dtype) for layer in shapes]


def flat_shapes(shapes) -> tuple:
    """One layer's cache shapes in the flat layout: [blocks, block_size, (heads,) d] -> [rows, d]."""
    return tuple((int(np.prod(s[:-1])), s[-1]) for s in shapes)


_CACHE_IDS = iter(range(1 << 62))


def zeros_cache(shapes, dtype=mstype.float32):
    """Zeroed Parameters of `shapes` (unique names: a compiled graph takes them as inputs): a tuple
    for (k, v), a single Parameter for one shape (MLA)."""
    n = next(_CACHE_IDS)
    tensors = tuple(
        Parameter(Tensor(np.zeros(s, np.float32)).astype(dtype), name=f"kv_cache_{n}_{i}", requires_grad=False)
        for i, s in enumerate(shapes)
    )
    return tensors if len(tensors) > 1 else tensors[0]
