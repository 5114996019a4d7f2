"""Run a schedule on real processes: MindSpore computes each stage, ``ms_layout.comm`` (gloo on
CPU, MindSpore's HCCL on Ascend) moves activations and gradients. Imports MindSpore."""

from __future__ import annotations

from .executor import PipelineRuntime, StepResult
from .stage import Stage
from .toy import ToyModel, reference_step, split_blocks, toy_batch

__all__ = ["PipelineRuntime", "Stage", "StepResult", "ToyModel", "reference_step", "split_blocks", "toy_batch"]
