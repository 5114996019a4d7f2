"""Compiled MTP drafting: the drafter's MTP module as one `mindspore.jit` graph per shape bucket.

The graph (`MTPGraph`, one per MTP module) does what the eager drafter does for one flat batch:
embed the tokens one step ahead, combine them with the given hidden states, run the module's
decoder layer over its own paged latent cache (a Parameter in the flat layout, written in the
graph) and return the greedy draft token at each requested row, with the layer's output hidden
states for a deeper draft. The batches it runs are cut from the drafter's batch by the same plan
as the target's steps (buckets.plan_step with `drafting=True`): a request with 1 accepted
position takes a decode bucket, 2..spec_width positions a draft bucket, a prompt chunk a prefill
bucket; a part that fits none runs the eager path (spec_decode.py) and is counted.
"""

from __future__ import annotations

import numpy as np
from mindspore import int32, jit, nn, ops

from .buckets import Bucket, BucketConfig, plan_step
from .compiled import compile_each, padded_inputs


class MTPGraph(nn.Cell):
    """One MTP module over a padded flat batch: (draft tokens [R] int32, hidden out [T, H])."""

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
        logits = self.lm.compute_logits(self.layer.shared_head(ops.gather(x, logits_rows, 0)))
        return self.argmax(logits), x


class CompiledDrafter:
    """The MTP modules' graphs for every drafting bucket of a BucketConfig."""

    def __init__(self, model, layers, caches, config: BucketConfig, block_size: int, scratch_block: int):
        self.config = config
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.graphs = [MTPGraph(model, layer, cache) for layer, cache in zip(layers, caches)]
        self.hidden_size = int(model.config.hidden_size)
        self.compile_s: dict[str, float] = {}
        """Seconds of the first (compiling) call of each (module, bucket)."""

    def run(self, module: int, bucket: Bucket, ids, positions, hidden, slots, tables, seq_lens, starts, rows):
        """(draft tokens of `rows` [len(rows)] numpy, hidden out [T, H]) of one part, compiled;
        `hidden` [T, H] is a MindSpore tensor of the part's real tokens."""
        t = len(ids)
        ids_t, pos_t, rows_t, meta = padded_inputs(
            ids, positions, slots, tables, seq_lens, starts, rows, bucket, self.scratch_block, self.block_size
        )
        pad = bucket.tokens - t
        if pad:  # padding tokens take hidden zeros (they write only the scratch block)
            hidden = ops.cat((hidden, ops.zeros((pad, self.hidden_size), hidden.dtype)), 0)
        tokens, x = self.graphs[module](ids_t, pos_t, hidden, rows_t, *meta)
        return tokens.asnumpy()[: len(rows)], x[:t]

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
