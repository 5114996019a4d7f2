"""An ms-models decoder cut into pipeline blocks: the embedding, each decoder layer, and a head.

ms_pipeline's runtime passes one tensor between blocks, so each layer block derives its RoPE
angles and causal mask from the hidden state's shape (as ms-pipeline's own ms-models test does),
and the head block maps (hidden, labels) to the microbatch's cross-entropy loss. Wrapping a Cell
renames its parameters, so the HF names are put back: ms-reshard, ms-probe and the checkpoint
all speak them.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops


class EmbedBlock(nn.Cell):
    def __init__(self, embed):
        super().__init__()
        self.embed = embed

    def construct(self, ids):
        return self.embed(ids)


class LayerBlock(nn.Cell):
    def __init__(self, layer, rotary):
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def construct(self, x):
        b, s = x.shape[0], x.shape[1]
        positions = ops.broadcast_to(ops.arange(0, s, 1, dtype=ms.int32).expand_dims(0), (b, s))
        cos, sin = self.rotary(positions)
        allowed = (ops.tril(ops.ones((s, s), ms.float32)) > 0.5).expand_dims(0).expand_dims(1)
        return self.layer(x, cos, sin, allowed)


class HeadBlock(nn.Cell):
    def __init__(self, norm, lm_head):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def construct(self, x, labels):
        logits = self.lm_head(self.norm(x))
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def model_blocks(model) -> list[nn.Cell]:
    """[embed, layer 0, ..., layer n-1, head] over the model's own Cells (weights shared)."""
    if model.lm_head is None:
        raise ValueError("a tied LM head would put one weight on two pipeline ranks; use an untied model")
    hf_names = {id(p): p.name for p in model.get_parameters()}
    inner = model.model
    blocks = [EmbedBlock(inner.embed_tokens)]
    blocks += [LayerBlock(layer, inner.rotary_emb) for layer in inner.layers]
    blocks.append(HeadBlock(inner.norm, model.lm_head))
    for block in blocks:
        for p in block.get_parameters():
            p.name = hf_names[id(p)]
    return blocks
