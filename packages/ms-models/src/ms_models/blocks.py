"""A decoder cut into pipeline blocks: the token embedding, each decoder layer, and a head.

A pipeline runtime (ms-pipeline's) passes one tensor between blocks, so each layer block derives
its RoPE angles and causal mask from the hidden state's shape, and the head block maps (hidden,
labels) to the microbatch's mean cross-entropy. The blocks hold the model's own Cells (weights are
shared, not copied); wrapping a Cell renames its parameters, so their HF names are put back, which
is what checkpoints, reshard plans and probe dumps speak. Each block also gives its explicit
passes (``explicit_passes()``: a forward that keeps what the backward needs, an input backward that
never re-runs it, a weight backward from the kept pairs), which ms-pipeline's Stage runs.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from .errors import ModelError


class EmbedBlock(nn.Cell):
    """token ids [B, S] -> hidden [B, S, H]"""

    def __init__(self, embed: nn.Cell):
        super().__init__()
        self.embed = embed

    def construct(self, ids):
        return self.embed(ids)

    def explicit_passes(self) -> nn.Cell:
        """Forward, input backward and weight backward by hand (ms_models.passes)."""
        from .passes import EmbedBlockPasses

        return EmbedBlockPasses(self)


def rope_and_mask(rotary: nn.Cell, x) -> tuple:
    """(cos, sin, causal mask) for a hidden state ``x`` [B, S, H]: positions 0..S-1 in every row."""
    b, s = x.shape[0], x.shape[1]
    positions = ops.broadcast_to(ops.arange(0, s, 1, dtype=ms.int32).expand_dims(0), (b, s))
    cos, sin = rotary(positions)
    allowed = (ops.tril(ops.ones((s, s), ms.float32)) > 0.5).expand_dims(0).expand_dims(1)
    return cos, sin, allowed


class LayerBlock(nn.Cell):
    """hidden -> hidden through one decoder layer, causal over the whole sequence"""

    def __init__(self, layer: nn.Cell, rotary: nn.Cell):
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def construct(self, x):
        cos, sin, allowed = rope_and_mask(self.rotary, x)
        return self.layer(x, cos, sin, allowed)

    def explicit_passes(self) -> nn.Cell:
        """Forward, input backward and weight backward by hand (ms_models.passes)."""
        from .passes import LayerBlockPasses

        return LayerBlockPasses(self)


class HeadBlock(nn.Cell):
    """(hidden, labels [B, S]) -> the mean next-token cross-entropy"""

    def __init__(self, norm: nn.Cell, lm_head: nn.Cell):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def construct(self, x, labels):
        logits = self.lm_head(self.norm(x))
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    def explicit_passes(self) -> nn.Cell:
        """Forward, input backward and weight backward by hand (ms_models.passes)."""
        from .passes import HeadBlockPasses

        return HeadBlockPasses(self)


def pipeline_blocks(model) -> list[nn.Cell]:
    """``[embed, layer 0, ..., layer n-1, head]`` over the model's own Cells, HF names kept.

    The MTP modules of DeepSeek-V3 are not part of the blocks (they train through
    ``mtp_forward``). A tied LM head is refused: its weight would sit on two pipeline ranks."""
    if model.lm_head is None:
        raise ModelError("tie_word_embeddings=True puts one weight on two pipeline ranks: untie it to cut into blocks")
    hf_names = {id(p): p.name for p in model.get_parameters()}
    inner = model.model
    blocks = [EmbedBlock(inner.embed_tokens)]
    blocks += [LayerBlock(layer, inner.rotary_emb) for layer in inner.layers]
    blocks.append(HeadBlock(inner.norm, model.lm_head))
    for block in blocks:
        for p in block.get_parameters():
            p.name = hf_names[id(p)]
    return blocks
