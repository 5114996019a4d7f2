"""Explicit passes of a whole decoder layer and of the pipeline blocks (embedding, layer, head).

A decoder layer is ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; its passes chain those of its
sublayers (:func:`sublayer_passes` picks them by type) with the RMSNorms and residuals in between.
The blocks' passes add what ``ms_models.blocks`` computes around the layers: the token lookup, the
RoPE angles and causal mask from the hidden state's shape, and the final norm, LM head and loss.
"""

from __future__ import annotations

from mindspore import nn, ops

from .. import fused
from ..blocks import rope_and_mask
from ..errors import ModelError
from . import host_ops
from . import ops as P
from .dense import AttentionPasses, MLPPasses

#: sublayer class name -> passes class; MLA and MoE register theirs in their own modules
SUBLAYER_PASSES: dict[str, type] = {"Attention": AttentionPasses, "MLP": MLPPasses}


def sublayer_passes(cell: nn.Cell) -> nn.Cell:
    """The passes Cell of an attention or MLP sublayer, by its class."""
    cls = SUBLAYER_PASSES.get(type(cell).__name__)
    if cls is None:
        raise ModelError(f"no explicit passes for {type(cell).__name__}; known: {sorted(SUBLAYER_PASSES)}")
    return cls(cell)


class DecoderLayerPasses(nn.Cell):
    """Passes of a pre-norm decoder layer (Llama, Qwen2, DeepSeek-V3): forward(x, cos, sin, allowed)."""

    def __init__(self, layer):
        super().__init__(auto_prefix=False)
        fused.refresh()  # whether the graphs compiled from these passes use the fused CPU kernels
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.attn, self.mlp = sublayer_passes(layer.self_attn), sublayer_passes(layer.mlp)

    def weights(self) -> list:
        return [self.norm1.weight, *self.attn.weights(), self.norm2.weight, *self.mlp.weights()]

    def forward(self, x, cos, sin, allowed):
        h1, n1, r1 = P.rms_norm(x, self.norm1.weight, self.norm1.eps)
        a, s_attn = self.attn.forward(h1, cos, sin, allowed)
        x = x + a
        h2, n2, r2 = P.rms_norm(x, self.norm2.weight, self.norm2.eps)
        m, s_mlp = self.mlp.forward(h2)
        return x + m, (n1, r1, s_attn, n2, r2, s_mlp)

    def backward_input(self, saved, g, cos, sin):
        n1, r1, s_attn, n2, r2, s_mlp = saved
        dh2, w_mlp = self.mlp.backward_input(s_mlp, g)
        g = g + P.rms_norm_dx(dh2, self.norm2.weight, n2, r2)
        dh1, w_attn = self.attn.backward_input(s_attn, g, cos, sin)
        return g + P.rms_norm_dx(dh1, self.norm1.weight, n1, r1), (n1, dh1, w_attn, n2, dh2, w_mlp)

    def backward_weight(self, pairs, k=P):
        n1, dh1, w_attn, n2, dh2, w_mlp = pairs
        return (
            (k.scale_dw(n1, dh1),)
            + self.attn.backward_weight(w_attn, k)
            + (k.scale_dw(n2, dh2),)
            + self.mlp.backward_weight(w_mlp, k)
        )


class EmbedBlockPasses(nn.Cell):
    """token ids [B, S] -> hidden; no input gradient (the input is data)."""

    has_input_grad = False
    host_kernels = host_ops  # backward_weight(pairs, host_ops) runs on numpy pairs

    def __init__(self, block):
        super().__init__(auto_prefix=False)
        fused.refresh()
        self.embed = block.embed
        self.vocab = block.embed.weight.shape[0]

    def weights(self) -> list:
        return [self.embed.weight]

    def forward(self, ids):
        return ops.gather(self.embed.weight, ids, 0), (ids,)

    def backward_input(self, saved, g):
        return g, (saved[0], g)  # the first value is a placeholder: nothing flows into the data

    def backward_weight(self, pairs, k=P):
        ids, g = pairs
        return (k.embedding_dw(ids, g, self.vocab),)


class LayerBlockPasses(nn.Cell):
    """hidden -> hidden through one decoder layer, causal over the whole sequence."""

    has_input_grad = True
    host_kernels = host_ops  # backward_weight(pairs, host_ops) runs on numpy pairs

    def __init__(self, block):
        super().__init__(auto_prefix=False)
        self.rotary = block.rotary
        self.layer = DecoderLayerPasses(block.layer)

    def weights(self) -> list:
        return self.layer.weights()

    def forward(self, x):
        cos, sin, allowed = rope_and_mask(self.rotary, x)
        return self.layer.forward(x, cos, sin, allowed)

    def backward_input(self, saved, g):
        cos, sin, _ = rope_and_mask(self.rotary, g)
        return self.layer.backward_input(saved, g, cos, sin)

    def backward_weight(self, pairs, k=P):
        return self.layer.backward_weight(pairs, k)


class HeadBlockPasses(nn.Cell):
    """(hidden, labels) -> mean next-token cross-entropy through the final norm and LM head."""

    has_input_grad = True
    host_kernels = host_ops  # backward_weight(pairs, host_ops) runs on numpy pairs

    def __init__(self, block):
        super().__init__(auto_prefix=False)
        fused.refresh()
        self.norm, self.lm_head = block.norm, block.lm_head

    def weights(self) -> list:
        return [self.norm.weight, self.lm_head.weight]

    def forward(self, x, labels):
        h, n, r = P.rms_norm(x, self.norm.weight, self.norm.eps)
        loss, s_loss = P.cross_entropy(P.linear(h, self.lm_head.weight), labels)
        return loss, (n, r, h, s_loss)

    def backward_input(self, saved, g):
        n, r, h, s_loss = saved
        dlogits = P.cross_entropy_dx(g, s_loss)
        dh = P.linear_dx(dlogits, self.lm_head.weight).reshape(h.shape)
        return P.rms_norm_dx(dh, self.norm.weight, n, r), (n, dh, h, dlogits)

    def backward_weight(self, pairs, k=P):
        n, dh, h, dlogits = pairs
        return (k.scale_dw(n, dh), k.linear_dw(h, dlogits))
