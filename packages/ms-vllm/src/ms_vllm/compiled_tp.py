"""Compiled steps of a tensor/expert-parallel rank: the paged forward cut at its collectives.

On CPU the collectives run on gloo (ms_layout.comm) over host arrays, outside any MindSpore graph,
so a TP step cannot be one graph. It is cut where Megatron's layers communicate, and every piece
between two collectives is one `mindspore.jit` graph per shape bucket:

    embed      the rank's rows of the vocabulary-parallel table (others zero)   -> all-reduce
    attn[i]    x + the previous delta, norm, attention over the layer's cache,
               the row-parallel o_proj's partial sum                           -> all-reduce
    mlp[i]     x + attention, norm, the MLP's (or MoE's) partial sum           -> all-reduce
    head       x + the last delta, final norm, the rank's vocabulary slice of
               the logits                                                      -> all-gather

so a model of L layers runs 2L + 2 graphs and 2L + 1 all-reduces a step, the collectives Megatron
has (two per layer) plus the embedding's. The TP cells (ms_models.parallel) are switched to `defer` mode
for this: each returns its partial sum and the graph after the collective adds the bias a
row-parallel linear adds once after its sum. Each graph returns the value the next collective
needs first (the one it computes last: reading another output first busy-waits the host thread,
docs/mindspore-cpu.md §15). A part that fits no bucket runs the same graphs at its own shape (they
compile for it then) and is counted as eager.
"""

from __future__ import annotations

import numpy as np
from mindspore import ParameterTuple, Tensor, jit, nn, ops

from ms_models import linear
from ms_models.parallel import RowParallelLinear, all_reduce, defer_collectives

from .batch import StepBatch
from .buckets import Bucket, BucketConfig
from .compiled import batch_inputs, compile_each, empty_batch


def _bias(cell) -> object:
    """The bias a row-parallel linear adds after its sum (None if it has none or is not one)."""
    return cell.bias if isinstance(cell, RowParallelLinear) else None


def _plus(x, delta, bias):
    x = x + delta
    return x if bias is None else x + bias


class _Cache(nn.Cell):
    """One layer's paged cache (k and v, or MLA's latent) held for a graph."""

    def __init__(self, cache):
        super().__init__()
        self.pair = isinstance(cache, (tuple, list))
        self.params = ParameterTuple(list(cache) if self.pair else [cache])

    def get(self):
        return (self.params[0], self.params[1]) if self.pair else self.params[0]


class EmbedSegment(nn.Cell):
    def __init__(self, embed):
        super().__init__()
        self.embed = embed

    @jit
    def construct(self, ids):
        return self.embed(ids)


class AttnSegment(nn.Cell):
    """x + delta (+ the previous MLP's bias), then the attention partial: (partial, x)."""

    def __init__(self, rotary, layer, cache, bias):
        super().__init__()
        self.rotary, self.layer, self.cache, self.bias = rotary, layer, _Cache(cache), bias

    @jit
    def construct(self, x, delta, positions, write_index, write_rows, context_slots, query_rows, padded_rows,
                  allowed, write_slots):  # fmt: skip
        x = _plus(x, delta, self.bias)
        meta = (write_index, write_rows, context_slots, query_rows, padded_rows, allowed, write_slots)
        cos, sin = self.rotary(positions)
        a = self.layer.self_attn.forward_paged(self.layer.input_layernorm(x), cos, sin, self.cache.get(), meta)
        return a, x


class MLPSegment(nn.Cell):
    """x + attention (+ o_proj's bias), then the MLP partial: (partial, x)."""

    def __init__(self, layer, bias):
        super().__init__()
        self.layer, self.bias = layer, bias

    @jit
    def construct(self, x, a):
        x = _plus(x, a, self.bias)
        return self.layer.mlp(self.layer.post_attention_layernorm(x)), x


class HeadSegment(nn.Cell):
    """x + the last delta, the final norm, this rank's vocabulary slice of the rows' logits."""

    def __init__(self, model, bias):
        super().__init__()
        self.norm, self.bias = model.model.norm, bias
        self.table = model.model.embed_tokens if model.tied else model.lm_head

    @jit
    def construct(self, x, delta, rows):
        h = self.norm(_plus(x, delta, self.bias))
        return linear(ops.gather(h, rows, 0), self.table.weight), h


class SegmentedSteps:
    """What every step cut into segments shares (TP here, DP + EP in compiled_ep.py): a part padded
    to its bucket, or at its own shape, through the subclass's `_forward(ids, positions, rows, meta,
    real)` (real: the part's token count before padding)."""

    def run(self, batch: StepBatch, bucket: Bucket):
        """(logits of the part's sample rows [R_real, V], hidden [T_real, H]) of one part, compiled."""
        ids, positions, rows, meta = batch_inputs(batch, bucket, self.scratch_block, self.block_size)
        logits, hidden = self._forward(ids, positions, rows, meta, len(batch.input_ids))
        return logits[: batch.logits_indices.size], hidden[: len(batch.input_ids)]

    def run_exact(self, batch: StepBatch):
        """A part no bucket fits: the same segments at its own shape (they compile for it)."""
        from ms_models import PagedMetadata

        rows = batch.logits_indices if batch.logits_indices.size else np.zeros(1, np.int32)
        meta = PagedMetadata.build(
            batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens, batch.query_start_loc,
            self.block_size,
        )  # fmt: skip
        ids, pos = Tensor(np.asarray(batch.input_ids, np.int32)), Tensor(np.asarray(batch.positions, np.int32))
        logits, hidden = self._forward(ids, pos, Tensor(np.asarray(rows, np.int32)), meta.tensors(), len(ids))
        return logits.asnumpy()[: batch.logits_indices.size], hidden


class CompiledTPSteps(SegmentedSteps):
    """One rank's compiled segments for every bucket of a BucketConfig (same interface as CompiledSteps)."""

    def __init__(self, model, kv_caches, config: BucketConfig, block_size: int, scratch_block: int, group):
        self.config, self.group = config, group
        self.block_size, self.scratch_block = block_size, scratch_block
        self.compile_s: dict[str, float] = {}
        """Seconds of the first (compiling) call of each bucket (all its segments)."""
        defer_collectives(model)
        m = model.model
        self.embed = EmbedSegment(m.embed_tokens)
        self.attn, self.mlp, bias = [], [], None
        for layer, cache in zip(m.layers, kv_caches):
            self.attn.append(AttnSegment(m.rotary_emb, layer, cache, bias))
            self.mlp.append(MLPSegment(layer, _bias(layer.self_attn.o_proj)))
            bias = _bias(getattr(layer.mlp, "down_proj", None))
        self.head = HeadSegment(model, bias)

    def _forward(self, ids, positions, rows, meta, real: int):
        """The segments and collectives of one padded (or exact) flat batch -> (logits [R, V], hidden)."""
        x = all_reduce(self.embed(ids), self.group)
        delta = ops.zeros(x.shape, x.dtype)
        for attn, mlp in zip(self.attn, self.mlp):
            a, x = attn(x, delta, positions, *meta)
            m, x = mlp(x, all_reduce(a, self.group))
            delta = all_reduce(m, self.group)
        local, hidden = self.head(x, delta, rows)
        part = np.ascontiguousarray(local.asnumpy())
        return Tensor.from_numpy(self.group.all_gather(part, axis=part.ndim - 1)), hidden

    def warm_up(self, progress: bool = True) -> dict[str, float]:
        """Compile every bucket's segments on all-padding batches (only the scratch block is written);
        every rank runs the same buckets in the same order, so the collectives pair up."""
        run = lambda bucket: self.run(empty_batch(), bucket)[0]  # noqa: E731
        self.compile_s.update(compile_each(self.config.buckets(), run, progress))
        return dict(self.compile_s)
