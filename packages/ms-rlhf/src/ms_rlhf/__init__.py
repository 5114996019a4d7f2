"""ms-rlhf: GRPO for MindSpore with uniform sampling, exact dynamic packing, online resharding
and bit-exact resume.

The core -- sampling.py (where rollout requests run), balance.py (Karmarkar-Karp partitions),
packing.py (``pack``), loss.py (the loss algebra), tasks.py, config.py (typed sections) -- needs numpy and ms-layout's
core (files, limits, console: numpy and msgpack). The
trainer lives in ``ms_rlhf.runtime`` (MindSpore, ms-models, ms-reshard, ms-layout) and is loaded
on first use of its names.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import checkpoint
from .balance import karmarkar_karp, lpt, makespan, partition
from .config import (
    CheckpointConfig,
    LossConfig,
    OptimizerConfig,
    PackingConfig,
    ParallelismConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
    load_config,
)
from .errors import CheckpointError, PackingError, RLHFError
from .loss import AGGREGATIONS, Row, build_row, group_advantages, reference_loss, sample_weights, token_terms
from .packing import Pack, PackPlan, lower_bound, next_fit, pack, padding_ratio, plan_packs, token_bound
from .sampling import Assignment, balanced_split, contiguous_split, split, uniform_split
from .serialize import register as _register
from .tasks import CharTokenizer, Prompt, PromptStream, make_task

__version__ = "0.1.0"

_register()  # PackPlan / Assignment into ms_layout.dumps/loads, where ms-layout is installed

_RUNTIME = {
    "GRPOTrainer": "ms_rlhf.runtime.trainer",
    "EmbeddedEngine": "ms_rlhf.runtime.rollout",
    "RolloutEngine": "ms_rlhf.runtime.rollout",
    "VllmEngine": "ms_rlhf.runtime.vllm_engine",
    "WeightSync": "ms_rlhf.runtime.sync",
    "train": "ms_rlhf.runtime.run",
}

__all__ = [
    "AGGREGATIONS",
    "Assignment",
    "CharTokenizer",
    "CheckpointConfig",
    "CheckpointError",
    "EmbeddedEngine",
    "GRPOTrainer",
    "LossConfig",
    "OptimizerConfig",
    "Pack",
    "PackPlan",
    "PackingConfig",
    "PackingError",
    "ParallelismConfig",
    "Prompt",
    "PromptStream",
    "RLHFError",
    "RolloutConfig",
    "RolloutEngine",
    "Row",
    "TaskConfig",
    "TrainConfig",
    "VllmEngine",
    "WeightSync",
    "balanced_split",
    "build_row",
    "checkpoint",
    "contiguous_split",
    "group_advantages",
    "karmarkar_karp",
    "load_config",
    "lower_bound",
    "lpt",
    "make_task",
    "makespan",
    "next_fit",
    "pack",
    "padding_ratio",
    "partition",
    "plan_packs",
    "reference_loss",
    "sample_weights",
    "split",
    "token_bound",
    "token_terms",
    "train",
    "uniform_split",
]


def __getattr__(name: str) -> Any:
    # The runtime imports MindSpore: load it only when one of its names is asked for.
    if name in _RUNTIME:
        return getattr(importlib.import_module(_RUNTIME[name]), name)
    raise AttributeError(f"module 'ms_rlhf' has no attribute {name!r}")
