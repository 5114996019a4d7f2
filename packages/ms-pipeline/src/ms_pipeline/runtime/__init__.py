"""Run a schedule on real processes: MindSpore computes each stage, ``ms_layout.comm`` (gloo on
CPU, MindSpore's HCCL on Ascend) moves activations and gradients. Imports MindSpore."""

from __future__ import annotations

from .demo import ToyConfig, run_demo, run_toy, setup_cpu, toy_setup
from .executor import PipelineRuntime, StepResult, interleave_layers
from .stage import Stage
from .toy import ToyModel, reference_step, split_blocks, toy_batch

__all__ = [
    "PipelineRuntime",
    "Stage",
    "StepResult",
    "ToyConfig",
    "ToyModel",
    "interleave_layers",
    "reference_step",
    "run_demo",
    "run_toy",
    "setup_cpu",
    "split_blocks",
    "toy_batch",
    "toy_setup",
]
