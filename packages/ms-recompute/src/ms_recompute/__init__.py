"""ms-recompute: activation recompute for MindSpore, with paired communication overlap and a planner.

Core (numpy + msgpack; no MindSpore):
    RecomputePlan, LayerPlan, Granularity, Prediction   -- the plan as data (print, parse, msgpack)
    pair_layers, RecomputeGroup, Step, Op              -- pairs of layers and the order inside each pair
    layer_memory, model_memory, Shape, LayerMemory     -- activation memory of a layer from its config
    plan_recompute, predict, layer_options, Option     -- least recompute time under a memory budget
    RecomputeError                                     -- bad input (a ValueError)

Runtime (``ms_recompute.runtime``, imports MindSpore): ``apply_plan(layers, plan)`` wraps layers or
sub-modules so they keep only their inputs; ``tp_layers`` builds tensor-parallel layers from an
ms_models model; ``SavedTensorMeter`` measures what the backward keeps.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import RecomputeError
from .memory import (
    LAYER_MODULES,
    LayerMemory,
    ModuleMemory,
    Shape,
    Term,
    layer_memory,
    megatron_bytes,
    model_memory,
    shared_bytes,
)
from .pairing import Op, RecomputeGroup, Step, check_order, pair_layers
from .plan import Granularity, LayerPlan, Prediction, RecomputePlan
from .planner import Option, layer_options, lowest_peak, plan_recompute, predict

__version__ = "0.1.0"

__all__ = [
    "LAYER_MODULES",
    "Granularity",
    "LayerMemory",
    "LayerPlan",
    "ModuleMemory",
    "Op",
    "Option",
    "Prediction",
    "RecomputeError",
    "RecomputeGroup",
    "RecomputePlan",
    "Shape",
    "Step",
    "Term",
    "check_order",
    "layer_memory",
    "layer_options",
    "lowest_peak",
    "megatron_bytes",
    "model_memory",
    "pair_layers",
    "plan_recompute",
    "predict",
    "runtime",
    "shared_bytes",
]


def __getattr__(name: str) -> Any:
    # the runtime imports MindSpore: loaded on first use so that the core stays numpy-only
    if name == "runtime":
        return importlib.import_module(".runtime", __name__)
    raise AttributeError(f"module 'ms_recompute' has no attribute {name!r}")
