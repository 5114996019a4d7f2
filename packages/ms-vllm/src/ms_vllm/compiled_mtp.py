"""Compiled MTP drafting: the drafter's MTP module as one `mindspore.jit` graph per shape bucket.

The graph (`MTPGraph`, one per MTP module) does what the eager drafter does for one flat batch:
embed the tokens one step ahead, combine them with the given hidden states, run the module's
decoder layer over its own paged latent cache (a Parameter in the flat layout, written in the
graph) and return the greedy draft token at each requested row, with the layer's output hidden
states for a deeper draft. The batches it runs are cut from the drafter's batch by the same plan
as the target's steps (buckets.plan_step with `drafting=True`): a request with 1 accepted
position takes a decode bucket, 2..spec_width positions a draft bucket, a prompt chunk a prefill
bucket; a part that fits none runs the eager path (spec_decode.py) and is counted.

Under tensor parallel (`group`) the module is cut at its collectives like the target's layers
(compiled_tp.py): `SegmentedMTP` runs the embedding, the combine, the layer's attention and MoE
partials and the vocabulary slice of the head as graphs, with the all-reduces and the logits'
all-gather between them on the host; every rank takes the same argmax. A part that fits no bucket
runs the same segments at its own shape (the cells are in defer mode: the eager path would skip
their collectives).
"""

from __future__ import annotations

import numpy as np
from mindspore import int32, jit, nn, ops

from .buckets import Bucket, BucketConfig, plan_step
from .compiled import compile_each, padded_inputs
from .compiled_tp import AttnSegment, EmbedSegment, MLPSegment, _bias, _plus


class MTPGraph(nn.Cell):
    """One MTP module over a padded flat batch: (draft tokens [R] int32, the layer's hidden output at
    those rows [R, H], what a deeper draft starts from)."""

    def __init__(self, model, layer, cache):
        super().__init__()
        self.lm = model
        self.layer = layer
        self.cache = cache
        self.argmax = ops.Argmax(axis=-1, output_type=int32)

    @jit
    def construct(self, input_ids, positions, hidden, logits_rows, write_index, write_rows, context_slots,
                  query_rows, padded_rows, allowed, write_slots):  # fmt: skip
        m = self.lm.model
        meta = (write_index, write_rows, context_slots, query_rows, padded_rows, allowed, write_slots)
        cos, sin = m.rotary_emb(positions)
        x = self.layer.combine(m.embed_tokens(input_ids), hidden)
        x = self.layer.forward_paged(x, cos, sin, self.cache, meta)
        x = ops.gather(x, logits_rows, 0)
        logits = self.lm.compute_logits(self.layer.shared_head(x))
        return self.argmax(logits), x


class CombineSegment(nn.Cell):
    """The MTP module's eh_proj over [enorm(embedded next tokens); hnorm(hidden)] (replicated weights)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    @jit
    def construct(self, embedded, hidden):
        return self.layer.combine(embedded, hidden)


class DraftHeadSegment(nn.Cell):
    """x + the MLP's summed partial, shared_head's norm at the draft rows, this rank's vocabulary slice."""

    def __init__(self, model, layer, bias):
        super().__init__()
        self.layer, self.bias = layer, bias
        self.table = model.model.embed_tokens if model.tied else model.lm_head

    @jit
    def construct(self, x, delta, rows):
        x = ops.gather(_plus(x, delta, self.bias), rows, 0)
        return ops.matmul(self.layer.shared_head(x), self.table.weight.T), x


class SegmentedMTP:
    """One MTP module of a tensor-parallel rank: MTPGraph's inputs and outputs, cut at the collectives."""

    def __init__(self, model, layer, cache, group):
        from ms_models.parallel import all_reduce

        self.all_reduce, self.group = all_reduce, group
        m = model.model
        self.embed, self.combine = EmbedSegment(m.embed_tokens), CombineSegment(layer)
        self.attn = AttnSegment(m.rotary_emb, layer, cache, None)
        self.mlp = MLPSegment(layer, _bias(layer.self_attn.o_proj))
        self.head = DraftHeadSegment(model, layer, _bias(getattr(layer.mlp, "down_proj", None)))

    def __call__(self, input_ids, positions, hidden, logits_rows, *meta):
        from mindspore import Tensor

        x = self.combine(self.all_reduce(self.embed(input_ids), self.group), hidden)
        a, x = self.attn(x, ops.zeros(x.shape, x.dtype), positions, *meta)
        m, x = self.mlp(x, self.all_reduce(a, self.group))
        local, x = self.head(x, self.all_reduce(m, self.group), logits_rows)
        part = np.ascontiguousarray(local.asnumpy())
        logits = self.group.all_gather(part, axis=part.ndim - 1)
        return Tensor(logits.argmax(-1).astype(np.int32)), x


class CompiledDrafter:
    """The MTP modules' graphs for every drafting bucket of a BucketConfig (under TP: SegmentedMTP)."""

    def __init__(
        self, model, layers, caches, config: BucketConfig, block_size: int, scratch_block: int, group=None,
        exchanged: bool = False,
    ):  # fmt: skip
        self.config = config
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.segmented = group is not None
        """True under TP or DP + EP: a part that fits no bucket runs `run_exact`, not the eager path."""
        self.exchanged = exchanged
        """True under DP + EP: the modules are cut at their experts' exchange (compiled_mtp_ep.py)."""
        if group is None:
            self.graphs = [MTPGraph(model, layer, cache) for layer, cache in zip(layers, caches)]
        elif exchanged:
            from .compiled_mtp_ep import ExchangedMTP

            self.graphs = [ExchangedMTP(model, layer, cache, group) for layer, cache in zip(layers, caches)]
        else:
            self.graphs = [SegmentedMTP(model, layer, cache, group) for layer, cache in zip(layers, caches)]
        self.hidden_size = int(model.config.hidden_size)
        self.compile_s: dict[str, float] = {}
        """Seconds of the first (compiling) call of each (module, bucket)."""

    def run(self, module: int, bucket: Bucket, ids, positions, hidden, slots, tables, seq_lens, starts, rows):
        """(draft tokens of `rows` [len(rows)] numpy, hidden out at `rows` [len(rows), H]) of one part,
        compiled; `hidden` [T, H] is a MindSpore tensor of the part's real tokens."""
        t = len(ids)
        ids_t, pos_t, rows_t, meta = padded_inputs(
            ids, positions, slots, tables, seq_lens, starts, rows, bucket, self.scratch_block, self.block_size
        )
        pad = bucket.tokens - t
        if pad:  # padding tokens take hidden zeros (they write only the scratch block)
            hidden = ops.cat((hidden, ops.zeros((pad, self.hidden_size), hidden.dtype)), 0)
        extra = {"real": t} if self.exchanged else {}  # (padding rows are not dispatched)
        tokens, x = self.graphs[module](ids_t, pos_t, hidden, rows_t, *meta, **extra)
        tokens = tokens.asnumpy()  # (computed last: read first, docs/mindspore-cpu.md §15)
        return tokens[: len(rows)], x if len(rows) == x.shape[0] else x[: len(rows)]

    def run_exact(self, module: int, ids, positions, hidden, slots, tables, seq_lens, starts, rows):
        """run() for a part no bucket fits, at its own shape (the segments compile for it)."""
        from mindspore import Tensor

        from ms_models import PagedMetadata

        meta = PagedMetadata.build(positions, slots, tables, seq_lens, starts, self.block_size)
        rows_t = Tensor(np.asarray(rows if len(rows) else [0], np.int32))
        ids_t, pos_t = Tensor(np.asarray(ids, np.int32)), Tensor(np.asarray(positions, np.int32))
        tokens, x = self.graphs[module](ids_t, pos_t, hidden, rows_t, *meta.tensors())
        return tokens.asnumpy()[: len(rows)], x[: len(rows)]

    def plan(self, starts: np.ndarray, seq_lens: np.ndarray, has_row: np.ndarray):
        """The parts of a drafting batch (requests' query starts, contexts, whether each drafts)."""
        return plan_step(np.diff(starts), seq_lens, has_row.astype(np.int64), self.config, drafting=True)

    def warm_up(self, progress: bool = True) -> dict[str, float]:
        """Compile every (module, drafting bucket) on all-padding batches (only the scratch block is written)."""
        from mindspore import Tensor

        none, empty = np.zeros(0, np.int32), Tensor(np.zeros((0, self.hidden_size), np.float32))
        tables, starts = np.zeros((0, 1), np.int32), np.zeros(1, np.int32)
        for k in range(len(self.graphs)):
            run = lambda b, k=k: self.run(k, b, none, none, empty, none, tables, none, starts, none)  # noqa: E731
            times = compile_each(self.config.buckets(drafting=True), run, progress, "ms-vllm: compiling MTP buckets")
            self.compile_s.update({f"mtp{k}:{name}": s for name, s in times.items()})
        return dict(self.compile_s)
