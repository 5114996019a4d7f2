"""Explicit training passes: forward, input backward and weight backward of every layer, by hand.

``ms.grad`` differentiates a whole function and re-runs its forward inside, and MindSpore cannot
keep a tape per microbatch; a pipeline schedule that splits the backward into an input half (B,
needed now by the previous stage) and a weight half (W, which fills bubbles later) then pays for
the forward two or three times. These passes avoid that: the forward returns every value its
backward needs, ``backward_input`` computes the input gradient and each weight's output gradient
from them, and ``backward_weight`` turns the kept (input, output-gradient) pairs into weight
gradients (``dW = g^T x``), with MindSpore's kernels (:mod:`.ops`, in a graph) or, on numpy
pairs, numpy's (:mod:`.host_ops`, the host's BLAS). All of it compiles under ``mindspore.jit``; each pass is checked
against ``ms.grad`` of the plain module in the tests.

The pipeline blocks of ``ms_models.blocks`` return theirs from ``explicit_passes()``, which is what
``ms_pipeline.runtime.Stage`` looks for.
"""

from __future__ import annotations

from . import host_ops, ops
from .dense import AttentionPasses, MLPPasses
from .layer import (
    SUBLAYER_PASSES,
    DecoderLayerPasses,
    EmbedBlockPasses,
    HeadBlockPasses,
    LayerBlockPasses,
    sublayer_passes,
)
from .mla import MLAPasses
from .moe import MoEPasses

SUBLAYER_PASSES.update({"MLAttention": MLAPasses, "MoE": MoEPasses})

__all__ = [
    "SUBLAYER_PASSES",
    "AttentionPasses",
    "DecoderLayerPasses",
    "EmbedBlockPasses",
    "HeadBlockPasses",
    "LayerBlockPasses",
    "MLAPasses",
    "MLPPasses",
    "MoEPasses",
    "host_ops",
    "ops",
    "sublayer_passes",
]
