"""Compiled MTP drafting on a DP-attention + EP rank: the MTP module cut at its MoE exchange.

DeepSeek-V3's MTP module is a decoder layer with an MoE, so under `--data-parallel-size N
--enable-expert-parallel` its routed experts are split over the DP ranks like the target's
(ms_models.parallel.DispatchMoE). `ExchangedMTP` runs one module as the target's EP steps run a
layer (compiled_ep.py):

    combine    embed the tokens one step ahead, eh_proj over [enorm(embedded); hnorm(hidden)]
    layer      attention over the module's latent cache, the router and shared experts
    exchange   host: the real rows to their experts' ranks and back (ms_models.parallel.dispatch)
    head       x + the routed output, shared_head's norm at the draft rows, logits, argmax

Each call holds exactly one exchange, as the eager padding forward of a rank without a draft does
(spec_decode.MTPDrafter.padding_forward), so the drafting forwards pair one by one over the ranks
(lockstep.OneByOne). A dense MTP layer (no routed experts) runs whole, with no exchange.
"""

from __future__ import annotations

from mindspore import int32, ops

from ms_models.parallel import DispatchMoE

from .compiled_ep import DenseLayerSegment, ExpertSegment, MoELayerSegment, routed_output
from .compiled_mtp import CombineSegment, DraftHeadSegment
from .compiled_tp import EmbedSegment


class ExchangedMTP:
    """One MTP module of a DP + EP rank: MTPGraph's inputs and outputs, cut at the experts' exchange."""

    def __init__(self, model, layer, cache, group):
        m = model.model
        self.group = group
        self.embed, self.combine = EmbedSegment(m.embed_tokens), CombineSegment(layer)
        self.moe = layer.mlp if isinstance(layer.mlp, DispatchMoE) else None
        if self.moe is None:
            self.layer, self.experts = DenseLayerSegment(m.rotary_emb, layer, cache), None
        else:
            self.layer, self.experts = MoELayerSegment(m.rotary_emb, layer, cache), ExpertSegment(self.moe.experts)
        self.head = DraftHeadSegment(model, layer, None)
        self.argmax = ops.Argmax(axis=-1, output_type=int32)

    def __call__(self, input_ids, positions, hidden, logits_rows, *meta, real: int | None = None):
        """(draft tokens at `logits_rows`, the layer's hidden output there); `real`: the rows before
        padding (padding rows stay on this rank)."""
        x = self.combine(self.embed(input_ids), hidden)
        zero = ops.zeros(x.shape, x.dtype)
        if self.moe is None:
            x, delta = self.layer(x, zero, positions, *meta), zero
        else:
            indices, weights, h, x = self.layer(x, zero, positions, *meta)
            real = h.shape[0] if real is None else real
            delta, _ = routed_output(self.group, self.moe, self.experts, indices, weights, h, real)
        logits, x = self.head(x, delta, logits_rows)
        return self.argmax(logits), x


__all__ = ["ExchangedMTP"]
