"""DeepSeek-V3 Multi-Token Prediction (MTP) modules.

Module k (stored as checkpoint layer num_hidden_layers + k, as in DeepSeek-V3's release) predicts
the token k + 2 steps ahead:

    h'  = eh_proj([enorm(embed(t_{i+k+1})) ; hnorm(h_i^{k})])     (concat order as vLLM loads it)
    h^{k+1} = decoder_layer(h')                                   (MLA + MoE block, own weights)
    logits  = lm_head(shared_head.norm(h^{k+1}))                  (embedding and head shared)

h^0 is the main model's final hidden state (after model.norm), as vLLM feeds it to the MTP
drafter. HF transformers' DeepseekV3ForCausalLM skips these weights (it ignores layer 61), so the
tests check this formula against an independent torch implementation.
"""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore import dtype as mstype

from .errors import ModelError
from .layers import RMSNorm, causal_mask


class SharedHead(nn.Cell):
    """The MTP module's own final norm (`shared_head.norm`); the head matrix is the model's lm_head."""

    def __init__(self, config):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def construct(self, x):
        return self.norm(x)


def mtp_forward(model, hidden, next_input_ids, positions=None, segment_ids=None, depth: int = 0):
    """See DeepseekV3ForCausalLM.mtp_forward."""
    layers = model.model.mtp_layers
    if layers is None or not 0 <= depth < len(layers):
        count = 0 if layers is None else len(layers)
        raise ModelError(f"MTP depth {depth} requested; the model has {count} MTP module(s)")
    ids = next_input_ids if isinstance(next_input_ids, Tensor) else Tensor(np.asarray(next_input_ids, np.int32))
    if positions is None:
        seq = ids.shape[-1]
        positions = ops.broadcast_to(ops.arange(0, seq, 1, dtype=mstype.int32).expand_dims(0), ids.shape)
    layer = layers[depth]
    cos, sin = model.model.rotary_emb(positions)
    x = layer.combine(model.model.embed_tokens(ids), hidden)
    x = layer(x, cos, sin, causal_mask(positions, segment_ids))
    return model.compute_logits(layer.shared_head(x)), x


def mtp_forward_paged(
    model,
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
    """See DeepseekV3ForCausalLM.mtp_forward_paged."""
    from .base import paged_inputs, select_rows

    layers = model.model.mtp_layers
    if layers is None or not 0 <= depth < len(layers):
        count = 0 if layers is None else len(layers)
        raise ModelError(f"MTP depth {depth} requested; the model has {count} MTP module(s)")
    ids, pos, meta = paged_inputs(
        input_ids, positions, mtp_cache, slot_mapping, block_tables, seq_lens, query_start_loc
    )
    layer = layers[depth]
    cos, sin = model.model.rotary_emb(pos)
    x = layer.combine(model.model.embed_tokens(ids), previous_hidden)
    x = layer.forward_paged(x, cos, sin, mtp_cache, meta)
    return model.compute_logits(layer.shared_head(select_rows(x, logits_indices))), x
