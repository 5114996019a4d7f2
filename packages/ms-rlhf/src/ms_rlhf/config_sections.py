"""The sections of the trainer's configuration: one typed dataclass per concern, each checking its
own fields and naming a bad one as ``section.field`` (config.py puts them together)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .config_keys import show
from .errors import RLHFError
from .limits import MAX_DATASET_SIZE, MAX_ROLLOUT_INSTANCES, MAX_ROLLOUT_SAMPLES, MAX_SEQ_LEN
from .loss import AGGREGATIONS
from .tasks import make_task


@dataclass
class TaskConfig:
    """The verifiable task and its fixed prompt set."""

    name: str = "add"
    """Verifiable task: "add" or "reverse" (tasks.py)."""
    params: dict[str, Any] = field(default_factory=lambda: {"max_operand": 4})
    """Task parameters, e.g. {"max_operand": 4} or {"alphabet": "abcd", "min_len": 2, "max_len": 4}."""
    dataset_size: int = 1024
    """Prompts in the fixed dataset drawn from the seed."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise RLHFError naming a bad field."""
        check_int(self.dataset_size, "task.dataset_size", 1)
        MAX_DATASET_SIZE.check(self.dataset_size, "config task.dataset_size", RLHFError)
        if not isinstance(self.params, dict):
            raise RLHFError(f"config task.params={show(self.params)}: expected an object")
        make_task(self.name, **self.params)  # the task checks its name and its own parameters


@dataclass
class RolloutConfig:
    """What each step generates, and the engine that generates it."""

    prompts_per_step: int = 8
    """Prompts per rollout (N)."""
    samples_per_prompt: int = 8
    """Samples per prompt (n, the GRPO group size)."""
    max_new_tokens: int = 6
    """Longest response."""
    temperature: float = 1.0
    """Sampling temperature of rollouts."""
    strategy: str = "uniform"
    """Where requests run: "uniform", "contiguous" or "balanced" (sampling.py)."""
    instances: int = 2
    """DP inference instances per rank (run one after another on one process)."""
    engine: str = "embedded"
    """"embedded" (an ms_models model in process) or "vllm" (vLLM with the ms-vllm plugin, installed separately)."""
    mode: str = "auto"
    """Embedded engine path: "paged" (ms_models forward_paged), "jit" (compiled recompute), "auto" (= jit if jit)."""
    block_size: int = 8
    """Paged KV-cache block size of the embedded engine."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise RLHFError naming a bad field."""
        for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "instances", "block_size"):
            check_int(getattr(self, name), f"rollout.{name}", 1)
        MAX_SEQ_LEN.check(self.max_new_tokens, "config rollout.max_new_tokens", RLHFError)
        MAX_SEQ_LEN.check(self.block_size, "config rollout.block_size", RLHFError)
        MAX_ROLLOUT_INSTANCES.check(self.instances, "config rollout.instances", RLHFError)
        samples, what = self.prompts_per_step * self.samples_per_prompt, "prompts_per_step * rollout.samples_per_prompt"
        MAX_ROLLOUT_SAMPLES.check(samples, f"config rollout.{what}", RLHFError)
        check_number(self.temperature, "rollout.temperature", 0.0)
        check_choice(self.strategy, "rollout.strategy", ("uniform", "contiguous", "balanced"))
        check_choice(self.engine, "rollout.engine", ("embedded", "vllm"))
        check_choice(self.mode, "rollout.mode", ("auto", "paged", "jit"))


@dataclass
class OptimizerConfig:
    """Adam on the master weights."""

    lr: float = 1e-2
    """Adam learning rate."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip (0: off)."""
    updates_per_rollout: int = 1
    """Mini-batches (optimizer steps) per rollout; old log-probs are those of the rollout policy."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise RLHFError naming a bad field."""
        check_number(self.lr, "optimizer.lr", 0.0)
        check_number(self.max_grad_norm, "optimizer.max_grad_norm", None)
        check_int(self.updates_per_rollout, "optimizer.updates_per_rollout", 1)


@dataclass
class LossConfig:
    """The GRPO loss: the clipped ratio term, the KL term and how tokens are averaged."""

    clip_eps: float = 0.2
    """PPO/GRPO ratio clip."""
    kl_coef: float = 0.005
    """Weight of the k3 KL term to the reference model."""
    aggregation: str = "seq-mean-token-mean"
    """How token terms are averaged: "seq-mean-token-mean", "token-mean", "seq-mean-token-sum"."""
    ref_sync_every: int = 0
    """Copy the policy into the reference model every this many steps (0: frozen reference)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise RLHFError naming a bad field."""
        check_number(self.clip_eps, "loss.clip_eps", None)
        check_number(self.kl_coef, "loss.kl_coef", None)
        check_choice(self.aggregation, "loss.aggregation", AGGREGATIONS)
        check_int(self.ref_sync_every, "loss.ref_sync_every", 0)


@dataclass
class PackingConfig:
    """How samples become the rows of training micro-batches."""

    enabled: bool = True
    """Pack samples (true) or pad micro-batches of micro_batch_size samples (false)."""
    max_len: int = 64
    """Most tokens per pack."""
    max_count: int | None = None
    """Most samples per pack (None: no limit)."""
    micro_batch_size: int = 4
    """Rows per micro-batch: packs when packing, samples (one per row) when padding."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise RLHFError naming a bad field."""
        check_bool(self.enabled, "packing.enabled")
        check_int(self.max_len, "packing.max_len", 1)
        MAX_SEQ_LEN.check(self.max_len, "config packing.max_len", RLHFError)
        count = self.max_count
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise RLHFError(f"config packing.max_count={show(count)}: expected a positive int or null")
        check_int(self.micro_batch_size, "packing.micro_batch_size", 1)
        MAX_ROLLOUT_SAMPLES.check(self.micro_batch_size, "config packing.micro_batch_size", RLHFError)


@dataclass
class ParallelismConfig:
    """How the training model and its optimizer state spread over the ranks (the rest is DP)."""

    optimizer_shard: bool = False
    """Keep master weights and Adam state split over the DP ranks (ZeRO-style); else replicated."""
    tp: int = 1
    """Tensor-parallel size of the training model (llama/qwen2; runs eagerly): the ranks form world / tp
    data-parallel replicas of tp consecutive ranks each."""
    pp: int = 1
    """Pipeline-parallel size of the training model: its blocks over all pp ranks of the run (dp = tp = 1),
    run by ms-pipeline's runtime with `pipeline_schedule`; needs packing.enabled=false."""
    pipeline_schedule: str = "zbv"
    """ms-pipeline schedule of the pipelined actor: "zbv" (ZeroBubbleV), "1f1b", "gpipe", ..."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise RLHFError naming a bad field."""
        check_bool(self.optimizer_shard, "parallel.optimizer_shard")
        check_int(self.tp, "parallel.tp", 1)
        check_int(self.pp, "parallel.pp", 1)
        if not isinstance(self.pipeline_schedule, str) or not self.pipeline_schedule:
            raise RLHFError(
                f"config parallel.pipeline_schedule={show(self.pipeline_schedule)}: expected a schedule name"
            )


@dataclass
class CheckpointConfig:
    """Where and how often checkpoints are written."""

    dir: str | None = None
    """Where checkpoints go (step_NNNNNN/ directories and a LATEST pointer)."""
    every: int = 0
    """Write a checkpoint every this many steps (0: only at the end when dir is set)."""
    keep: int = 2
    """How many checkpoints to keep."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise RLHFError naming a bad field."""
        check_path(self.dir, "checkpoint.dir")
        check_int(self.every, "checkpoint.every", 0)
        check_int(self.keep, "checkpoint.keep", 1)


def check_int(value: Any, key: str, low: int) -> None:
    """An int >= `low` (1 or 0), not a bool."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RLHFError(f"config {key}={show(value)}: expected {'a positive int' if low == 1 else 'an int >= 0'}")


def check_number(value: Any, key: str, above: float | None) -> None:
    """A finite number > `above`, or >= 0 with above=None."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or (value <= above if above is not None else value < 0):
        want = f"a finite number > {above:g}" if above is not None else "a finite number >= 0"
        raise RLHFError(f"config {key}={show(value)}: expected {want}")


def check_bool(value: Any, key: str) -> None:
    """true or false."""
    if not isinstance(value, bool):
        raise RLHFError(f"config {key}={show(value)}: expected true or false")


def check_path(value: Any, key: str) -> None:
    """A non-empty path without NUL, or None."""
    if value is not None and (not isinstance(value, str) or not value or "\x00" in value):
        raise RLHFError(f"config {key}={show(value)}: expected a path or null")


def check_choice(value: Any, key: str, choices) -> None:
    """One of `choices` (strings)."""
    if not isinstance(value, str) or value not in choices:
        raise RLHFError(f"config {key}={show(value)}: expected one of {list(choices)}")
