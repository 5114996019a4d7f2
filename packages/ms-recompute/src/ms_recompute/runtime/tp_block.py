"""Tensor-parallel decoder layers as one pipeline block that brings its own passes.

A pipeline stage compiles its blocks' explicit passes into one graph per pass, which a stage with
TP layers cannot do: the layers' all-reduces sit between the graphs. :class:`TPStackBlock` holds
consecutive TP layer shards (``tp_model``'s ``TPDecoderLayer`` cells) and offers
``pipeline_passes()``, the protocol ms-pipeline's Stage chains in Python (the other blocks of the
stage stay compiled graphs):

* ``forward(x) -> (y, kept)``: :meth:`CompiledTPStack.forward` (each g all-reduce between two
  compiled segments; with recompute only each layer's input is kept);
* ``backward_input(kept, g) -> (dx, pairs)``: B alone (ZeroBubbleV's split), each f all-reduce
  waited for at once, recompute in pairs (one layer's all-reduce in flight while the other
  computes);
* ``backward_weight(pairs) -> grads``: W, numpy arrays in ``weights()`` order, no communication;
* ``backward_full(kept, g) -> (dx, grads)``: BW (1F1B), each f all-reduce in flight under the
  same sublayer's weight gradients;
* ``forward_steps``, ``backward_input_steps``, ``backward_full_steps``: the same passes as
  generators that yield right after issuing each collective, so that ms-pipeline can run the two
  halves of a 1B1F pair layer by layer, one's all-reduce in flight while the other computes.

:func:`tp_stage_blocks` cuts a ``tp_model`` into per-stage block lists: the embedding joins the
first stage and the head the last, each stage's layers become one ``TPStackBlock``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn

from ms_models.blocks import rope_and_mask

from ..errors import RecomputeError
from .compiled_tp import CompiledTPStack, Kept, Steps, drain


class TPStackBlock(nn.Cell):
    """Consecutive TP decoder layers (``TPDecoderLayer``) of one rank, as one pipeline block:
    hidden -> hidden, causal over the whole sequence. ``construct`` is the PyNative form (each
    all-reduce synchronous); ``pipeline_passes()`` the compiled one, recompute paired or not."""

    def __init__(
        self,
        layers: Sequence[nn.Cell],
        rotary: nn.Cell,
        group: Any,
        *,
        recompute: bool = True,
        paired: bool = True,
        overlap: bool = True,
        jit: bool = True,
    ):
        super().__init__()
        if not layers:
            raise RecomputeError("TPStackBlock needs at least one TP decoder layer")
        names = {id(p): p.name for layer in layers for p in layer.get_parameters()}
        self.layers = nn.CellList(list(layers))
        self.rotary, self.group = rotary, group
        self.options = dict(recompute=recompute, paired=paired, overlap=overlap, jit=jit)
        for p in self.get_parameters():  # the CellList renamed them: keep the model's names
            p.name = names[id(p)]
        self._passes: TPStackPasses | None = None

    def construct(self, x):
        cos, sin, allowed = rope_and_mask(self.rotary, x)
        for layer in self.layers:
            x = layer(x, cos, sin, allowed)
        return x

    def pipeline_passes(self) -> TPStackPasses:
        """The block's passes (one object per block: its compiled segments are built once)."""
        if self._passes is None:
            self._passes = TPStackPasses(self)
        return self._passes


class TPStackPasses:
    """ms-pipeline's block-passes protocol over a :class:`CompiledTPStack`."""

    def __init__(self, block: TPStackBlock):
        self.block = block
        self.stack = CompiledTPStack([layer.layer for layer in block.layers], block.group, **block.options)
        self._rope = ms.jit(self._rope_fn) if block.options["jit"] else self._rope_fn

    def _rope_fn(self, x):
        return rope_and_mask(self.block.rotary, x)

    def weights(self) -> list[ms.Parameter]:
        return [p for layer in self.stack.weights() for p in layer]

    def forward(self, x: ms.Tensor) -> tuple[ms.Tensor, Kept]:
        return drain(self.forward_steps(x))

    def backward_input(self, kept: Kept, g: ms.Tensor) -> tuple[ms.Tensor, list]:
        return self.stack.backward_input(kept, g)

    def backward_weight(self, pairs: list) -> list[np.ndarray]:
        return [g for layer in self.stack.backward_weight(pairs) for g in layer]

    def backward_full(self, kept: Kept, g: ms.Tensor) -> tuple[ms.Tensor, list[np.ndarray]]:
        return drain(self.backward_full_steps(kept, g))

    # the same passes as steps (each yields after issuing a collective): ms-pipeline interleaves
    # the two halves of a 1B1F pair through them, layer by layer
    def forward_steps(self, x: ms.Tensor) -> Steps:
        cos, sin, allowed = self._rope(x)
        return (yield from self.stack.forward_steps(x, cos, sin, allowed))

    def backward_input_steps(self, kept: Kept, g: ms.Tensor) -> Steps:
        return (yield from self.stack.backward_input_steps(kept, g))

    def backward_full_steps(self, kept: Kept, g: ms.Tensor) -> Steps:
        dx, grads = yield from self.stack.backward_steps(kept, g)
        return dx, [x for layer in grads for x in layer]


def tp_stage_blocks(tp_net: Any, layer_counts: Sequence[int], group: Any, **options: Any) -> list[list[nn.Cell]]:
    """Per pipeline stage, the blocks of a ``tp_model`` (its TP group ``group``): the embedding
    joins stage 0, the head the last stage, and each stage's ``layer_counts[s]`` consecutive layers
    become one :class:`TPStackBlock` (``options``: recompute, paired, overlap, jit)."""
    import ms_models

    blocks = ms_models.pipeline_blocks(tp_net)
    embed, layer_blocks, head = blocks[0], blocks[1:-1], blocks[-1]
    counts = [int(c) for c in layer_counts]
    if any(c < 0 for c in counts) or sum(counts) != len(layer_blocks):
        raise RecomputeError(
            f"layer_counts {list(layer_counts)} must be >= 0 and add up to the {len(layer_blocks)} layers"
        )
    stages, start = [], 0
    for s, n in enumerate(counts):
        stage: list[nn.Cell] = [embed] if s == 0 else []
        if n:
            chunk = layer_blocks[start : start + n]
            stage.append(TPStackBlock([b.layer for b in chunk], chunk[0].rotary, group, **options))
        if s == len(counts) - 1:
            stage.append(head)
        stages.append(stage)
        start += n
    return stages


__all__ = ["TPStackBlock", "TPStackPasses", "tp_stage_blocks"]
