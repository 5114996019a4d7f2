"""ms-reshard: plan and run the resharding of tensors and models between any two layouts.

The planner, the plans and ``apply_local`` need numpy and msgpack only; ``reshard_parameters``
(the online executor) loads MindSpore and ``ms_layout.comm`` when first named; the checkpoint
functions (``save_checkpoint``, ``load_checkpoint``, ``reshard_checkpoint``) need safetensors and
tqdm when called.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import serialize as _serialize  # registers the plan kinds with ms_layout.dumps/loads
from .checkpoint import load_checkpoint, load_manifest, read_rank, reshard_checkpoint, save_checkpoint
from .errors import ReshardError
from .fusion import DEFAULT_FUSIONS, FusionRule, load_rules, rules_from_data
from .local import apply_local, apply_model_local
from .model_plan import ModelPlan, ParamSpec, PartMove, PlanCache, itemsize_of, model_plan
from .plan import Collective, Op, OpKind, TensorPlan, format_plan
from .planner import plan
from .serialize import plan_from_bytes, plan_to_bytes
from .specs import param_specs, stored_layout
from .validate import validate

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_FUSIONS",
    "Collective",
    "FusionRule",
    "ModelPlan",
    "Op",
    "OpKind",
    "ParamSpec",
    "PartMove",
    "PlanCache",
    "ReshardError",
    "TensorPlan",
    "apply_local",
    "apply_model_local",
    "format_plan",
    "itemsize_of",
    "load_checkpoint",
    "load_manifest",
    "load_rules",
    "model_plan",
    "param_specs",
    "plan",
    "plan_from_bytes",
    "plan_to_bytes",
    "read_rank",
    "reshard_checkpoint",
    "reshard_parameters",
    "rules_from_data",
    "save_checkpoint",
    "stored_layout",
    "validate",
]

del _serialize

# The online executor imports MindSpore: loaded on first use so that the core stays numpy-only.
_LAZY = {"reshard_parameters": ".execute"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'ms_reshard' has no attribute {name!r}")
