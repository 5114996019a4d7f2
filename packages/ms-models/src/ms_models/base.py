"""What every causal LM here shares: the two forward paths around a family-specific decoder.

A model is `XForCausalLM` with `.model` (embed_tokens, layers, norm, rotary_emb; HF names) and
`.lm_head` (None with tied embeddings: the logits then use model.embed_tokens.weight).

- Training: `model(input_ids, positions=None, segment_ids=None)` on [batch, seq] ids returns
  [batch, seq, vocab] logits; `forward_packed(ids, cu_seqlens)` packs samples into one row with
  positions restarting per sample and no attention across samples.
- Inference: `forward_paged(...)` over a flat batch of tokens and a paged KV cache (paged_cache.py).
"""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore import dtype as mstype

from .errors import ModelError
from .layers import Linear, causal_mask, linear
from .paged_cache import PagedMetadata, allocate_kv_caches


def packed_positions(cu_seqlens) -> tuple[np.ndarray, np.ndarray]:
    """Positions (restarting at 0 per sample) and segment ids for samples packed back to back.

    cu_seqlens = [0, len0, len0 + len1, ...] as in FlashAttention's varlen API.
    """
    cu = np.asarray(cu_seqlens.asnumpy() if isinstance(cu_seqlens, Tensor) else cu_seqlens, np.int64)
    if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) <= 0):
        raise ModelError(f"cu_seqlens {cu.tolist()} must start at 0 and strictly increase")
    lengths = np.diff(cu)
    segments = np.repeat(np.arange(len(lengths)), lengths)
    positions = np.arange(cu[-1]) - cu[:-1][segments]
    return positions.astype(np.int32), segments.astype(np.int32)


def _tensor(x, dtype=np.int32) -> Tensor:
    return x.astype(mstype.int32) if isinstance(x, Tensor) else Tensor(np.asarray(x, dtype))


def paged_inputs(
    input_ids, positions, layer_cache, slot_mapping, block_tables, seq_lens, query_start_loc, block_size=None
):
    """(ids, positions, PagedMetadata) for one paged call; the block size is read off a layer's
    [blocks, block_size, ...] cache unless given (slot-major caches need it given)."""
    first = layer_cache[0] if isinstance(layer_cache, (tuple, list)) else layer_cache
    bs = block_size or first.shape[1]
    meta = PagedMetadata.build(positions, slot_mapping, block_tables, seq_lens, query_start_loc, bs)
    return _tensor(input_ids), _tensor(positions), meta


def select_rows(x, rows):
    """x[rows] (rows: None for all, or indices)."""
    return x if rows is None else x[_tensor(rows)]


class CausalLM(nn.Cell):
    """Base of LlamaForCausalLM, Qwen2ForCausalLM and DeepseekV3ForCausalLM."""

    config_class = None

    def __init__(self, config, model: nn.Cell, rng=None):
        super().__init__()
        self.config = config
        self.model = model
        self.tied = bool(config.tie_word_embeddings)
        self.lm_head = (
            None if self.tied else Linear(config.hidden_size, config.vocab_size, False, config.initializer_range, rng)
        )

    def compute_logits(self, hidden):
        """hidden [..., hidden_size] -> logits [..., vocab_size]."""
        if self.tied:
            return linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)

    def hidden_states(self, input_ids, positions=None, segment_ids=None):
        """The final normed hidden states [B, S, H] of the training path."""
        if positions is None:
            seq = input_ids.shape[-1]
            positions = ops.broadcast_to(ops.arange(0, seq, 1, dtype=mstype.int32).expand_dims(0), input_ids.shape)
        return self.model(input_ids, positions, causal_mask(positions, segment_ids))

    def construct(self, input_ids, positions=None, segment_ids=None):
        """Training forward: [B, S] ids (positions default 0..S-1; segment_ids for packed rows) -> [B, S, V]."""
        return self.compute_logits(self.hidden_states(input_ids, positions, segment_ids))

    def forward_packed(self, input_ids, cu_seqlens):
        """Samples packed in one row: ids [T] or [1, T] and cu_seqlens [n + 1] -> logits [1, T, V]."""
        ids = input_ids if isinstance(input_ids, Tensor) else Tensor(np.asarray(input_ids, np.int32))
        ids = ids.reshape(1, -1)
        positions, segments = packed_positions(cu_seqlens)
        if positions.shape[0] != ids.shape[1]:
            raise ModelError(f"cu_seqlens cover {positions.shape[0]} tokens but input_ids has {ids.shape[1]}")
        return self(ids, Tensor(positions[None]), Tensor(segments[None]))

    # ------------------------------------------------------------------ paged inference
    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[tuple[int, ...], ...]]:
        """Per layer, the shapes of its cache tensors (see allocate_kv_caches)."""
        return [layer.self_attn.cache_shapes(num_blocks, block_size) for layer in self.model.layers]

    def allocate_kv_caches(self, num_blocks: int, block_size: int, dtype=mstype.float32) -> list:
        """Zeroed paged caches for every layer."""
        return allocate_kv_caches(self, num_blocks, block_size, dtype)

    def forward_paged(
        self,
        input_ids,
        positions,
        kv_caches,
        slot_mapping=None,
        block_tables=None,
        seq_lens=None,
        query_start_loc=None,
        logits_indices=None,
        return_hidden: bool = False,
        meta: PagedMetadata | None = None,
        block_size: int | None = None,
    ):
        """Inference over a flat token batch mixing prefills and decodes (vLLM's layout).

        input_ids, positions, slot_mapping: [T]; block_tables [N, max_blocks]; seq_lens [N] (context
        length including this step's tokens); query_start_loc [N + 1]. kv_caches (from
        allocate_kv_caches) are written in place. Returns logits [T, V], or only the rows in
        `logits_indices` (for example each sequence's last token). With `return_hidden`, returns
        (logits, hidden [T, H]): the final normed hidden states of all rows, which an MTP drafter takes.

        `block_size` is read off the caches unless given; slot-major caches
        (allocate_kv_caches(flat=True)) need it given.

        A caller that built the PagedMetadata itself (padded to a compiled bucket, for example)
        passes it as `meta` instead of slot_mapping .. query_start_loc, with int32 tensors for
        input_ids, positions and logits_indices; the work is then `paged_step`, which compiles.
        """
        if len(kv_caches) != len(self.model.layers):
            raise ModelError(f"{len(kv_caches)} kv caches for {len(self.model.layers)} layers")
        if meta is None:
            if slot_mapping is None or block_tables is None or seq_lens is None or query_start_loc is None:
                raise ModelError("forward_paged needs slot_mapping, block_tables, seq_lens, query_start_loc, or meta")
            input_ids, positions, meta = paged_inputs(
                input_ids, positions, kv_caches[0], slot_mapping, block_tables, seq_lens, query_start_loc, block_size
            )
            logits_indices = None if logits_indices is None else _tensor(logits_indices)
        logits, hidden = self.paged_step(input_ids, positions, kv_caches, meta, logits_indices)
        return (logits, hidden) if return_hidden else logits

    def paged_step(self, input_ids, positions, kv_caches, meta: PagedMetadata, logits_indices=None):
        """The body of forward_paged once its inputs are tensors: (logits of `logits_indices`, or of
        every row for None, and the hidden states [T, H]). No checks, no numpy: this is what a
        caller compiles with `mindspore.jit` (the caches held as Parameters)."""
        hidden = self.model.forward_paged(input_ids, positions, kv_caches, meta)
        logits = self.compute_logits(hidden if logits_indices is None else ops.gather(hidden, logits_indices, 0))
        return logits, hidden

    def num_params(self) -> int:
        """Number of parameter elements."""
        return sum(int(np.prod(p.shape)) for p in self.get_parameters())
