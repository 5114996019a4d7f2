"""The trainer's configuration: one flat dataclass, read from JSON or TOML.

Unknown keys and bad values raise RLHFError naming them, so a typo never silently falls back to a
default. ``ms-rlhf train --config FILE`` reads this; :meth:`TrainConfig.to_dict` is what
checkpoints store.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ms_layout.files import FileError, read_capped

from .errors import RLHFError
from .limits import (
    MAX_CONFIG_BYTES,
    MAX_DATASET_SIZE,
    MAX_MODEL_DIM,
    MAX_ROLLOUT_INSTANCES,
    MAX_ROLLOUT_SAMPLES,
    MAX_SEQ_LEN,
)
from .loss import AGGREGATIONS
from .tasks import make_task

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
    tp: int = 1
    """Tensor-parallel size of the training model (llama/qwen2; runs eagerly): the ranks form
    world / tp data-parallel replicas of tp consecutive ranks each."""
    pp: int = 1
    """Pipeline-parallel size of the training model: its blocks over all pp ranks of the run
    (dp = tp = 1), run by ms-pipeline's runtime with `pipeline_schedule`; needs packing=false."""
    pipeline_schedule: str = "zbv"
    """ms-pipeline schedule of the pipelined actor: "zbv" (ZeroBubbleV), "1f1b", "gpipe", ..."""
    ref_sync_every: int = 0
    """Copy the policy into the reference model every this many steps (0: frozen reference)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (step_NNNNNN/ directories and a LATEST pointer)."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many steps (0: only at the end when checkpoint_dir is set)."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep."""
    jit: bool = True
    """Compile log-probs, loss and gradients with mindspore.jit (rows padded to one width: max_pack_len
    when packing, else the longest prompt + max_new_tokens); false: eager, the debug path. A
    tensor-parallel actor (tp > 1) runs eagerly either way (its collectives run on the host)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise RLHFError on a value that cannot run (a wrong type, out of range, over a limit)."""
        for name in _POSITIVE:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RLHFError(f"config {name}={_show(value)}: expected a positive int")
        for name in ("checkpoint_every", "ref_sync_every", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RLHFError(f"config {name}={_show(value)}: expected an int >= 0")
        for name, limit in _LIMITED.items():
            limit.check(getattr(self, name), f"config {name}", RLHFError)
        MAX_ROLLOUT_SAMPLES.check(
            self.prompts_per_step * self.samples_per_prompt, "config prompts_per_step * samples_per_prompt", RLHFError
        )
        for name, above in (("lr", 0.0), ("temperature", 0.0), ("max_grad_norm", None), ("clip_eps", None)):
            _number(self, name, above)  # above=None: >= 0
        _number(self, "kl_coef", None)
        for name in ("packing", "optimizer_shard", "jit"):
            if not isinstance(getattr(self, name), bool):
                raise RLHFError(f"config {name}={_show(getattr(self, name))}: expected true or false")
        for name in ("checkpoint_dir", "model_path"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or "\x00" in value):
                raise RLHFError(f"config {name}={_show(value)}: expected a path or null")
        for name, choices in _CHOICES.items():
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in choices:
                raise RLHFError(f"config {name}={_show(getattr(self, name))}: expected one of {list(choices)}")
        count = self.max_pack_count
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise RLHFError(f"config max_pack_count={_show(count)}: expected a positive int or null")
        if self.prompts_per_step * self.samples_per_prompt % self.updates_per_rollout:
            raise RLHFError(
                f"config updates_per_rollout={self.updates_per_rollout} must divide the "
                f"{self.prompts_per_step * self.samples_per_prompt} samples of a rollout"
            )
        if not isinstance(self.pipeline_schedule, str) or not self.pipeline_schedule:
            raise RLHFError(f"config pipeline_schedule={_show(self.pipeline_schedule)}: expected a schedule name")
        if self.pp > 1 and (self.packing or self.tp > 1):
            raise RLHFError(
                f"config pp={self.pp} needs packing=false and tp=1 (pipeline blocks see each row as one causal "
                f"sequence; got packing={self.packing}, tp={self.tp})"
            )
        if not isinstance(self.task_params, dict):
            raise RLHFError(f"config task_params={_show(self.task_params)}: expected an object")
        make_task(self.task, **self.task_params)  # the task checks its own parameters
        _check_model(self.model)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from plain data; unknown keys are an error naming them."""
        if not isinstance(data, dict):
            raise RLHFError(f"config must be an object (a mapping of keys), got {type(data).__name__}")
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
        raw = read_capped(path, MAX_CONFIG_BYTES.value, "config")
    except FileError as exc:  # missing, a folder, or over the limit
        hint = f" (raise it with {MAX_CONFIG_BYTES.env}=N)" if "over the limit" in str(exc) else ""
        raise RLHFError(f"{exc}{hint}") from None
    except OSError as exc:
        raise RLHFError(f"cannot read config {path!r}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RLHFError(f"config {path!r} is not UTF-8 text (byte {exc.start})") from None
    kind = "TOML" if path.endswith(".toml") else "JSON"
    try:
        if kind == "TOML":
            import tomllib  # Python >= 3.11

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except ImportError:
        raise RLHFError("TOML configs need Python >= 3.11; use JSON") from None
    except RecursionError:
        raise RLHFError(f"config {path!r} is not valid {kind}: nested too deeply") from None
    except ValueError as exc:  # the decoders' errors, a 5,000-digit int
        raise RLHFError(f"config {path!r} is not valid {kind}: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(data, dict):
        raise RLHFError(f"config {path!r} holds a {type(data).__name__}; expected an object of config keys")
    return TrainConfig.from_dict({**data, **(overrides or {})})


_POSITIVE = (
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
    "tp",
    "pp",
)
_LIMITED = {
    "dataset_size": MAX_DATASET_SIZE,
    "max_new_tokens": MAX_SEQ_LEN,
    "max_pack_len": MAX_SEQ_LEN,
    "block_size": MAX_SEQ_LEN,
    "micro_batch_size": MAX_ROLLOUT_SAMPLES,
    "rollout_instances": MAX_ROLLOUT_INSTANCES,
}
_CHOICES = {
    "loss_aggregation": AGGREGATIONS,
    "rollout_strategy": ("uniform", "contiguous", "balanced"),
    "rollout_engine": ("embedded", "vllm"),
    "rollout_mode": ("auto", "paged", "jit"),
}


def _show(value: Any) -> str:
    """A value for an error message: its repr, cut short."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**100 else f"<int of {len(str(value))} digits>"
    return text if len(text) <= 80 else text[:77] + "..."


def _number(config: TrainConfig, name: str, above: float | None) -> None:
    value = getattr(config, name)
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or (value <= above if above is not None else value < 0):
        want = f"a finite number > {above:g}" if above is not None else "a finite number >= 0"
        raise RLHFError(f"config {name}={_show(value)}: expected {want}")


def _check_model(model: Any) -> None:
    """The `model` overrides: an object of plain values, integers within MS_RLHF_MAX_MODEL_DIM."""
    if not isinstance(model, dict):
        raise RLHFError(f"config model={_show(model)}: expected an object of ms_models config fields")
    if not isinstance(model.get("arch", "llama"), str):
        raise RLHFError(f"config model.arch={_show(model['arch'])}: expected a name such as 'llama'")
    for key, value in model.items():
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 0:
                raise RLHFError(f"config model.{key}={value}: expected an int >= 0")
            MAX_MODEL_DIM.check(value, f"config model.{key}", RLHFError)
        elif value is not None and not isinstance(value, (bool, float, str)):
            raise RLHFError(f"config model.{key}={_show(value)}: expected a number, a string, true/false or null")
