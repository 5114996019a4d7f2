"""ms-reshard: plan and run the resharding of tensors and models between any two layouts.

The planner, the plans and ``apply_local`` need numpy and msgpack only; ``ms_reshard.execute``
(the online executor) loads MindSpore and ``ms_layout.comm``; ``ms_reshard.checkpoint`` needs
safetensors and tqdm.
"""

from __future__ import annotations

from .errors import ReshardError
from .local import apply_local
from .plan import Collective, Op, OpKind, TensorPlan, format_plan
from .planner import plan

__version__ = "0.1.0"

__all__ = [
    "Collective",
    "Op",
    "OpKind",
    "ReshardError",
    "TensorPlan",
    "apply_local",
    "format_plan",
    "plan",
]
