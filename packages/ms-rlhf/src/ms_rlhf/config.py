"""The trainer's configuration: one flat dataclass, read from JSON or TOML.

Unknown keys and bad values raise RLHFError naming them, so a typo never silently falls back to a
default. ``ms-rlhf train --config FILE`` reads this; :meth:`TrainConfig.to_dict` is what
checkpoints store.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .errors import RLHFError
from .loss import AGGREGATIONS

DEFAULT_MODEL = {
    "arch": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}
"""A one-layer Llama small enough to train on two CPU cores in a CI run."""


@dataclass
class TrainConfig:
    """Everything a GRPO run needs."""

    task: str = "add"
    """Verifiable task: "add" or "reverse" (tasks.py)."""
    task_params: dict[str, Any] = field(default_factory=lambda: {"max_operand": 4})
    """Task parameters, e.g. {"max_operand": 4} or {"alphabet": "abcd", "min_len": 2, "max_len": 4}."""
    dataset_size: int = 1024
    """Prompts in the fixed dataset drawn from the seed."""
    model: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_MODEL))
    """ms_models tiny_config arch and field overrides (vocab_size comes from the task's tokenizer)."""
    model_path: str | None = None
    """Start from this ms_models checkpoint directory instead (its vocabulary must cover the task's)."""
    seed: int = 0
    """Seeds the model init, the dataset, the sampler and every rollout sample."""
    steps: int = 40
    """Rollout + update steps to run."""
    prompts_per_step: int = 8
    """Prompts per rollout (N)."""
    samples_per_prompt: int = 8
    """Samples per prompt (n, the GRPO group size)."""
    max_new_tokens: int = 6
    """Longest response."""
    temperature: float = 1.0
    """Sampling temperature of rollouts."""
    lr: float = 1e-2
    """Adam learning rate."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip (0: off)."""
    clip_eps: float = 0.2
    """PPO/GRPO ratio clip."""
    kl_coef: float = 0.005
    """Weight of the k3 KL term to the reference model."""
    loss_aggregation: str = "seq-mean-token-mean"
    """How token terms are averaged: "seq-mean-token-mean", "token-mean", "seq-mean-token-sum"."""
    updates_per_rollout: int = 1
    """Mini-batches (optimizer steps) per rollout; old log-probs are those of the rollout policy."""
    packing: bool = True
    """Pack samples (True) or pad micro-batches of micro_batch_size samples (False)."""
    max_pack_len: int = 64
    """Most tokens per pack."""
    max_pack_count: int | None = None
    """Most samples per pack (None: no limit)."""
    micro_batch_size: int = 4
    """Rows per micro-batch: packs when packing, samples (one per row) when padding."""
    rollout_strategy: str = "uniform"
    """Where requests run: "uniform", "contiguous" or "balanced" (sampling.py)."""
    rollout_instances: int = 2
    """DP inference instances per rank (run one after another on one process)."""
    rollout_engine: str = "embedded"
    """"embedded" (an ms_models model in process) or "vllm" (vLLM with the ms-vllm plugin, installed separately)."""
    rollout_mode: str = "auto"
    """Embedded engine path: "paged" (ms_models forward_paged), "jit" (compiled recompute), "auto" (= jit if jit)."""
    block_size: int = 8
    """Paged KV-cache block size of the embedded engine."""
    optimizer_shard: bool = False
    """Keep master weights and Adam state split over the DP ranks (ZeRO-style); else replicated."""
    ref_sync_every: int = 0
    """Copy the policy into the reference model every this many steps (0: frozen reference)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (step_NNNNNN/ directories and a LATEST pointer)."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many steps (0: only at the end when checkpoint_dir is set)."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep."""
    jit: bool = False
    """Compile the loss/gradient function with mindspore.jit (shapes are then padded to max_pack_len)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise RLHFError on a value that cannot run."""
        positive = (
            "dataset_size",
            "steps",
            "prompts_per_step",
            "samples_per_prompt",
            "max_new_tokens",
            "updates_per_rollout",
            "max_pack_len",
            "micro_batch_size",
            "rollout_instances",
            "block_size",
            "keep_checkpoints",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RLHFError(f"config {name}={value!r}: expected a positive int")
        for name in ("checkpoint_every", "ref_sync_every", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RLHFError(f"config {name}={value!r}: expected an int >= 0")
        for name in ("lr", "temperature"):
            if not float(getattr(self, name)) > 0:
                raise RLHFError(f"config {name}={getattr(self, name)!r}: expected > 0")
        for name in ("max_grad_norm", "clip_eps", "kl_coef"):
            if not float(getattr(self, name)) >= 0:
                raise RLHFError(f"config {name}={getattr(self, name)!r}: expected >= 0")
        if self.loss_aggregation not in AGGREGATIONS:
            raise RLHFError(f"config loss_aggregation={self.loss_aggregation!r}: expected one of {AGGREGATIONS}")
        if self.rollout_strategy not in ("uniform", "contiguous", "balanced"):
            raise RLHFError(f"config rollout_strategy={self.rollout_strategy!r}: expected uniform/contiguous/balanced")
        if self.rollout_engine not in ("embedded", "vllm"):
            raise RLHFError(f"config rollout_engine={self.rollout_engine!r}: expected 'embedded' or 'vllm'")
        if self.rollout_mode not in ("auto", "paged", "jit"):
            raise RLHFError(f"config rollout_mode={self.rollout_mode!r}: expected 'auto', 'paged' or 'jit'")
        if self.max_pack_count is not None and (not isinstance(self.max_pack_count, int) or self.max_pack_count < 1):
            raise RLHFError(f"config max_pack_count={self.max_pack_count!r}: expected a positive int or null")
        if self.prompts_per_step * self.samples_per_prompt % self.updates_per_rollout:
            raise RLHFError(
                f"config updates_per_rollout={self.updates_per_rollout} must divide the "
                f"{self.prompts_per_step * self.samples_per_prompt} samples of a rollout"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from plain data; unknown keys are an error naming them."""
        if not isinstance(data, dict):
            raise RLHFError(f"config must be a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RLHFError(f"unknown config keys {unknown}; known keys: {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise RLHFError(f"bad config: {exc}") from None


def load_config(path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Read a TrainConfig from a .json or .toml file, then apply `overrides`."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise RLHFError(f"cannot read config {path!r}: {exc.strerror}") from None
    if path.endswith(".toml"):
        try:
            import tomllib
        except ImportError:  # Python < 3.11
            raise RLHFError("TOML configs need Python >= 3.11; use JSON") from None
        try:
            data = tomllib.loads(raw.decode())
        except tomllib.TOMLDecodeError as exc:
            raise RLHFError(f"config {path!r} is not valid TOML: {exc}") from None
    else:
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise RLHFError(f"config {path!r} is not valid JSON: {exc}") from None
    return TrainConfig.from_dict({**data, **(overrides or {})})
