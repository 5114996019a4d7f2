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
MTP module over them: compiled (compiled_mtp.py: the batch cut into the same shape buckets as the
target's steps) once `compile` ran, else eagerly, and a part that fits no bucket eagerly too.
"""

from __future__ import annotations

import numpy as np

from .batch import DraftBatch
from .lockstep import OneByOne


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
        self.compiled = None
        """compiled_mtp.CompiledDrafter once compile() ran; None: every draft runs eagerly."""
        self.num_drafts = 0
        """Drafts proposed so far (the scheduler counts the accepted ones)."""
        self.calls = {"compiled": 0, "eager": 0}
        """MTP module calls, compiled and eager."""
        self.pairing = OneByOne(None, lambda: None)
        """Under DP + EP, the MTP layer's expert exchanges paired over the DP ranks (lockstep.py)."""

    def cache_shapes(self, num_blocks: int, block_size: int) -> list:
        return [layer.self_attn.cache_shapes(num_blocks, block_size) for layer in self.layers]

    def allocate(self, num_blocks: int, block_size: int, flat: bool = False) -> None:
        self.caches = self.model.allocate_mtp_kv_caches(num_blocks, block_size, flat=flat)

    def compile(
        self, config, block_size: int, scratch_block: int, progress: bool = True, group=None, exchanged: bool = False
    ) -> dict[str, float]:
        """Compile the modules' drafting buckets (needs the flat caches) -> seconds per bucket; with a
        tensor-parallel `group`, as segments between its collectives; `exchanged` (DP + EP), as
        segments around the experts' exchange."""
        from .compiled_mtp import CompiledDrafter

        self.compiled = CompiledDrafter(
            self.model, self.layers, self.caches, config, block_size, scratch_block, group, exchanged
        )
        return self.compiled.warm_up(progress)

    def _run(self, depth: int, ids, positions, hidden, slots, tables, seq_lens, starts, block_size):
        """One MTP module over a flat batch, eagerly -> (its output hidden states, MindSpore tensor)."""
        from mindspore import Tensor

        from ms_models import PagedMetadata

        idx = depth % len(self.layers)
        layer, m = self.layers[idx], self.model.model
        meta = PagedMetadata.build(positions, slots, tables, seq_lens, starts, block_size)
        pos = Tensor(positions.astype(np.int32))
        cos, sin = m.rotary_emb(pos)
        x = layer.combine(m.embed_tokens(Tensor(ids.astype(np.int32))), hidden)
        return layer.forward_paged(x, cos, sin, self.caches[idx], meta)

    def padding_forward(self, scratch_block: int, block_size: int) -> None:
        """An eager MTP forward of one padding token written to the scratch block (no request owns
        it): this rank's part of another DP rank's drafting exchange."""
        from mindspore import ops

        zero, one = np.zeros(1, np.int32), np.ones(1, np.int32)
        hidden = ops.zeros((1, int(self.model.config.hidden_size)), self.model.model.embed_tokens.weight.dtype)
        slot = np.array([scratch_block * block_size], np.int32)
        self._run(0, zero, zero, hidden, slot, np.array([[scratch_block]], np.int32), one, np.array([0, 1], np.int32),
                  block_size).asnumpy()  # fmt: skip

    def _draft(self, depth: int, x_rows) -> np.ndarray:
        layer = self.layers[depth % len(self.layers)]
        return self.model.compute_logits(layer.shared_head(x_rows)).asnumpy().argmax(-1)

    def _forward(self, depth, ids, positions, hidden, slots, tables, seq_lens, starts, has_row, block_size):
        """The module of `depth` over a flat batch of requests (query `starts`), in compiled parts
        where they fit a bucket -> (draft token of each request with has_row, in order; the
        module's hidden state at those rows [n, H]). With one part in request order (the common
        case) no MindSpore op runs outside the graph: each is a PyNative dispatch of its own."""
        from mindspore import Tensor, ops

        parts = self.compiled.plan(starts, seq_lens, has_row) if self.compiled else None
        if parts is None:
            from .buckets import Part

            parts = [Part(list(range(len(seq_lens))), None)]
        tokens, blocks = {}, []
        for part in parts:
            reqs = np.asarray(part.requests, np.int64)
            spans = [np.arange(starts[i], starts[i + 1]) for i in reqs]
            flat = np.concatenate(spans).astype(np.int64) if spans else np.zeros(0, np.int64)
            sub_starts = np.concatenate([[0], np.cumsum([len(x) for x in spans])]).astype(np.int32)
            drafting = [j for j, i in enumerate(reqs) if has_row[i]]
            local = np.asarray([sub_starts[j + 1] - 1 for j in drafting], np.int32)
            whole = len(flat) == hidden.shape[0] and np.array_equal(flat, np.arange(len(flat)))
            part_hidden = hidden if whole else hidden[Tensor(flat.astype(np.int32))]
            args = (ids[flat], positions[flat], part_hidden, slots[flat], tables[reqs], seq_lens[reqs], sub_starts)
            with self.pairing.forward():
                toks, x_rows = self._part(depth, part, args, local, block_size)
            owners = [int(reqs[j]) for j in drafting]
            tokens.update({i: int(t) for i, t in zip(owners, toks)})
            if owners:
                blocks.append((owners, x_rows))
        order = sorted(tokens)
        hidden_out = None
        if blocks:
            owners = [i for ids_, _ in blocks for i in ids_]
            hidden_out = blocks[0][1] if len(blocks) == 1 else ops.cat([x for _, x in blocks], 0)
            if owners != order:
                hidden_out = ops.gather(hidden_out, Tensor(np.argsort(owners).astype(np.int32)), 0)
        return [tokens[i] for i in order], hidden_out

    def _part(self, depth: int, part, args: tuple, local: np.ndarray, block_size: int):
        """(draft tokens, hidden states at `local` rows) of one part: its bucket's graph, else eagerly
        (under TP at its own shape: the TP cells defer their collectives)."""
        from mindspore import Tensor

        module = depth % len(self.layers)
        if part.bucket is not None:
            self.calls["compiled"] += 1
            return self.compiled.run(module, part.bucket, *args, local)
        self.calls["eager"] += 1
        if self.compiled is not None and self.compiled.segmented:
            return self.compiled.run_exact(module, *args, local)
        x = self._run(depth, *args, block_size)
        x_rows = x[Tensor(local)] if len(local) else None
        return (self._draft(depth, x_rows) if len(local) else np.zeros(0, np.int64)), x_rows

    def propose(self, draft: DraftBatch, hidden, block_size: int):
        """(req_ids, drafts) for the requests that got tokens this step, from the batch builder's
        DraftBatch and the step's hidden states; the MTP caches are updated for every position
        whose next token is known."""
        from mindspore import Tensor

        if not draft.hidden_rows.size:
            return None
        starts = draft.query_start_loc
        ends = set((draft.last_rows + 1).tolist())  # a drafting request's last row ends its query
        has_row = np.asarray([starts[i + 1] > starts[i] and int(starts[i + 1]) in ends for i in range(len(starts) - 1)])
        rows = draft.hidden_rows
        same = len(rows) == hidden.shape[0] and np.array_equal(rows, np.arange(len(rows)))
        step_hidden = hidden if same else hidden[Tensor(rows)]
        first, last_hidden = self._forward(
            0, draft.input_ids, draft.positions, step_hidden, draft.slot_mapping, draft.block_tables,
            draft.seq_lens, starts, has_row, block_size,
        )  # fmt: skip
        if not draft.owners:
            return None
        drafts = [[t] for t in first]
        self._chain(draft.owner_blocks, draft.positions[draft.last_rows], last_hidden, drafts, block_size)
        self.num_drafts += sum(len(d) for d in drafts)
        return draft.owners, drafts

    def _chain(self, blocks, last_pos, hidden, drafts, bs: int) -> None:
        """Depths 1..k-1: feed each draft and the previous depth's hidden state back in."""
        n = len(blocks)
        for depth in range(1, self.k):
            pos = last_pos + depth
            if any(p // bs >= len(b) for p, b in zip(pos, blocks)):
                return  # no reserved slot for the deeper draft: propose fewer
            width = max(len(b) for b in blocks)
            tables = np.zeros((n, width), np.int32)
            for i, b in enumerate(blocks):
                tables[i, : len(b)] = b
            slots = np.asarray([b[p // bs] * bs + p % bs for p, b in zip(pos, blocks)])
            toks = np.asarray([d[-1] for d in drafts])
            new, hidden = self._forward(depth, toks, pos, hidden, slots, tables, pos + 1, np.arange(n + 1),
                                        np.ones(n, bool), bs)  # fmt: skip
            for d, t in zip(drafts, new):
                d.append(int(t))
