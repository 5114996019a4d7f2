"""The DeepSeek-V3 decoder: MLA attention, dense first layers then DeepSeekMoE, optional MTP."""

from __future__ import annotations

import numpy as np
from mindspore import nn, ops

from .base import CausalLM
from .config import DeepseekV3Config
from .dense import DecoderModel, LlamaDecoderLayer
from .layers import MLP, Linear, RMSNorm
from .mla import MLAttention
from .moe import MoE
from .mtp import SharedHead, mtp_forward, mtp_forward_paged


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    """Pre-norm block with MLA and, from layer first_k_dense_replace on, a MoE MLP."""

    def __init__(self, config: DeepseekV3Config, index: int, rng=None):
        nn.Cell.__init__(self)
        c = config
        self.self_attn = MLAttention(c, rng)
        if c.is_moe_layer(index):
            self.mlp = MoE(c, rng)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, False, c.initializer_range, rng)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class MTPLayer(DeepseekV3DecoderLayer):
    """One MTP module: enorm, hnorm, eh_proj, a full decoder layer (self_attn, mlp, norms), shared_head.norm."""

    def __init__(self, config: DeepseekV3Config, index: int, rng=None):
        super().__init__(config, index, rng)
        c = config
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = Linear(2 * c.hidden_size, c.hidden_size, False, c.initializer_range, rng)
        self.shared_head = SharedHead(c)

    def combine(self, embeds, hidden):
        """eh_proj([enorm(embeds); hnorm(hidden)])."""
        return self.eh_proj(ops.cat((self.enorm(embeds), self.hnorm(hidden)), -1))


class DeepseekV3Model(DecoderModel):
    """embed_tokens -> layers -> norm, plus the MTP modules in `mtp_layers` (not run by construct)."""

    def __init__(self, config: DeepseekV3Config, rng=None):
        layers = [DeepseekV3DecoderLayer(config, i, rng) for i in range(config.num_hidden_layers)]
        super().__init__(config, layers, rng)
        count = config.num_nextn_predict_layers
        mtp = [MTPLayer(config, config.num_hidden_layers + k, rng) for k in range(count)]
        self.mtp_layers = nn.CellList(mtp) if mtp else None


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 with an LM head (HF DeepseekV3ForCausalLM names; MTP as in DeepSeek's checkpoint)."""

    config_class = DeepseekV3Config

    def __init__(self, config: DeepseekV3Config, seed: int = 0):
        if not isinstance(config, DeepseekV3Config):
            raise TypeError(f"DeepseekV3ForCausalLM needs a DeepseekV3Config, got {type(config).__name__}")
        rng = np.random.default_rng(seed)
        super().__init__(config, DeepseekV3Model(config, rng), rng)

    def set_moe_impl(self, impl: str) -> None:
        """Run every MoE layer "dense" (default, jit-friendly) or "dispatch" (PyNative, sparse)."""
        for cell in self.cells_and_names():
            if isinstance(cell[1], MoE):
                cell[1].set_impl(impl)

    def mtp_forward(self, hidden, next_input_ids, positions=None, segment_ids=None, depth: int = 0):
        """MTP module `depth`: hidden [B, S, H] (the main model's final hidden states, or the
        previous depth's output) and the ids of the tokens one step ahead [B, S]
        -> (logits [B, S, V] for the tokens two steps ahead, this depth's hidden states)."""
        return mtp_forward(self, hidden, next_input_ids, positions, segment_ids, depth)

    def allocate_mtp_kv_caches(self, num_blocks: int, block_size: int, flat: bool = False) -> list:
        """One zeroed latent cache per MTP module, like the main layers' (see allocate_kv_caches;
        `flat`: slot-major, the layout compiled steps write in place)."""
        from .paged_cache import flat_shapes, zeros_cache

        shapes = [layer.self_attn.cache_shapes(num_blocks, block_size) for layer in self.model.mtp_layers or []]
        return [zeros_cache(flat_shapes(s) if flat else s) for s in shapes]

    def mtp_forward_paged(
        self,
        input_ids,
        positions,
        previous_hidden,
        mtp_cache,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        depth: int = 0,
        logits_indices=None,
    ):
        """MTP module `depth` over a flat paged batch (its own cache from allocate_mtp_kv_caches()[depth]):
        input_ids [T] are the tokens one step ahead of the rows whose `previous_hidden` [T, H] is given
        (main model: forward_paged(..., return_hidden=True)). Returns (logits, this depth's hidden [T, H])."""
        return mtp_forward_paged(
            self,
            input_ids,
            positions,
            previous_hidden,
            mtp_cache,
            slot_mapping,
            block_tables,
            seq_lens,
            query_start_loc,
            depth,
            logits_indices,
        )

    def extra_hub_tensors(self) -> dict[str, np.ndarray]:
        """DeepSeek-V3's checkpoint repeats the shared embedding and head in each MTP layer."""
        out = {}
        embed = self.model.embed_tokens.weight.asnumpy()
        head = embed if self.tied else self.lm_head.weight.asnumpy()
        for k in range(self.config.num_nextn_predict_layers):
            prefix = f"model.layers.{self.config.num_hidden_layers + k}"
            out[f"{prefix}.embed_tokens.weight"] = embed
            out[f"{prefix}.shared_head.head.weight"] = head
        return out

    def ignored_hub_names(self) -> set[str]:
        """Checkpoint names read but not loaded: the MTP copies of the shared embedding and head."""
        return set(self.extra_hub_tensors())
