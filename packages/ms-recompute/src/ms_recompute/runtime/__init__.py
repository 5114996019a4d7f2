"""Recompute at run time (imports MindSpore): apply a plan, measure what the backward keeps, run
tensor-parallel layers whose recompute overlaps communication in pairs.

    applied = apply_plan(model, plan)          # hooks only: cell tree and parameter names unchanged
    ... ms.grad(...) ...                       # full backward, or split dx / dw passes
    applied.remove()

``checkpoint(fn, *args)`` recomputes a plain function; ``SavedTensorMeter`` counts the bytes the tape
keeps; ``tp_model`` builds a tensor-parallel ms_models model over an ``ms_layout.comm`` group;
``CompiledTPStack`` trains its layers compiled, recompute paired under jit; ``tp_stage_blocks``
cuts a ``tp_model`` into pipeline stages whose TP layers (``TPStackBlock``) ms-pipeline chains.
"""

from __future__ import annotations

from .apply import AppliedPlan, apply_plan
from .checkpoint import AllReduce, Checkpoint, Runner, TraceEvent, checkpoint, run_sync
from .compiled_tp import CompiledTPStack, TPLayerPasses
from .meter import SavedTensorMeter
from .tp import CopyToTP, TPDecoderLayer, tp_model
from .tp_block import TPStackBlock, TPStackPasses, tp_stage_blocks

__all__ = [
    "AllReduce",
    "AppliedPlan",
    "Checkpoint",
    "CompiledTPStack",
    "CopyToTP",
    "Runner",
    "SavedTensorMeter",
    "TPDecoderLayer",
    "TPLayerPasses",
    "TPStackBlock",
    "TPStackPasses",
    "TraceEvent",
    "apply_plan",
    "checkpoint",
    "run_sync",
    "tp_model",
    "tp_stage_blocks",
]
