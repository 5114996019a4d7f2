"""MTP speculative decoding for DeepSeek-V3: the model's own MTP module drafts the next tokens.

vLLM's `speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": k}` makes the
scheduler reserve k lookahead slots, schedule each request's drafts after its next token, and roll
back `num_computed_tokens` for rejected drafts. The worker verifies the drafts (model_runner.py)
and, after each step, proposes new ones here, as vLLM's EAGLE/MTP proposer does:

    MTP input at position p = (final hidden state h_p of the target, token at p + 1)

for every position whose next token is now known (a prefill chunk's positions; up to the last
accepted token of a decode), so the MTP layer's own paged cache (same block ids as the target's)
holds every position it will attend to. The draft is the argmax of the MTP logits at the last of
those positions; for k > 1 the module is chained on its own output hidden state and draft token
(module d % n_mtp at depth d, vLLM's reuse of one module for deeper drafts). The batch builder
(batch.build_draft_batch) derives these inputs from the step's batch; the drafter only runs the
MTP module over them (eagerly: it is not compiled yet).
"""

from __future__ import annotations

import numpy as np

from .batch import DraftBatch


class MTPDrafter:
    """Greedy drafts from the model's MTP modules, with their own paged caches."""

    def __init__(self, model, speculative_config):
        method = getattr(speculative_config, "method", None)
        if method not in ("deepseek_mtp", "mtp"):
            raise ValueError(f"speculative method {method!r}: ms-vllm drafts with the model's MTP module only")
        layers = getattr(model.model, "mtp_layers", None)
        if layers is None or len(layers) == 0:
            raise ValueError("the model has no MTP module (num_nextn_predict_layers = 0)")
        self.model = model
        self.layers = layers
        self.k = int(speculative_config.num_speculative_tokens)
        self.caches: list | None = None
        self.num_drafts = 0
        """Drafts proposed so far (the scheduler counts the accepted ones)."""

    def cache_shapes(self, num_blocks: int, block_size: int) -> list:
        return [layer.self_attn.cache_shapes(num_blocks, block_size) for layer in self.layers]

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.caches = self.model.allocate_mtp_kv_caches(num_blocks, block_size)

    def _run(self, depth: int, ids, positions, hidden, slots, tables, seq_lens, starts, block_size):
        """One MTP module over a flat batch -> (its output hidden states, MindSpore tensor)."""
        from mindspore import Tensor

        from ms_models import PagedMetadata

        idx = depth % len(self.layers)
        layer, m = self.layers[idx], self.model.model
        meta = PagedMetadata.build(positions, slots, tables, seq_lens, starts, block_size)
        pos = Tensor(positions.astype(np.int32))
        cos, sin = m.rotary_emb(pos)
        x = layer.combine(m.embed_tokens(Tensor(ids.astype(np.int32))), hidden)
        return layer.forward_paged(x, cos, sin, self.caches[idx], meta)

    def _draft(self, depth: int, x, rows: np.ndarray) -> np.ndarray:
        from mindspore import Tensor

        layer = self.layers[depth % len(self.layers)]
        logits = self.model.compute_logits(layer.shared_head(x[Tensor(rows.astype(np.int32))]))
        return logits.asnumpy().argmax(-1)

    def propose(self, draft: DraftBatch, hidden, block_size: int):
        """(req_ids, drafts) for the requests that got tokens this step, from the batch builder's
        DraftBatch and the step's hidden states; the MTP caches are updated for every position
        whose next token is known."""
        from mindspore import Tensor

        if not draft.hidden_rows.size:
            return None
        x = self._run(
            0,
            draft.input_ids,
            draft.positions,
            hidden[Tensor(draft.hidden_rows)],
            draft.slot_mapping,
            draft.block_tables,
            draft.seq_lens,
            draft.query_start_loc,
            block_size,
        )
        if not draft.owners:
            return None
        last = draft.last_rows
        drafts = [[int(t)] for t in self._draft(0, x, last)]
        self._chain(draft.owner_blocks, draft.positions[last], x, last, drafts, block_size)
        self.num_drafts += sum(len(d) for d in drafts)
        return draft.owners, drafts

    def _chain(self, blocks, last_pos, x, last_rows, drafts, bs: int) -> None:
        """Depths 1..k-1: feed each draft and the previous depth's hidden state back in."""
        from mindspore import Tensor

        hidden = x[Tensor(last_rows.astype(np.int32))]
        for depth in range(1, self.k):
            pos = last_pos + depth
            if any(p // bs >= len(b) for p, b in zip(pos, blocks)):
                return  # no reserved slot for the deeper draft: propose fewer
            width = max(len(b) for b in blocks)
            tables = np.zeros((len(blocks), width), np.int32)
            for i, b in enumerate(blocks):
                tables[i, : len(b)] = b
            slots = np.asarray([b[p // bs] * bs + p % bs for p, b in zip(pos, blocks)])
            toks = np.asarray([d[-1] for d in drafts])
            n = len(blocks)
            hidden = self._run(depth, toks, pos, hidden, slots, tables, pos + 1, np.arange(n + 1), bs)
            for d, t in zip(drafts, self._draft(depth, hidden, np.arange(n))):
                d.append(int(t))
