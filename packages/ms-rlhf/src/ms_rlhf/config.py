"""The trainer's configuration: a few run-wide keys and one typed section per concern, read from
JSON or TOML.

A config file (TOML here; JSON holds the same objects)::

    steps = 40                  # run-wide: seed, steps, jit, model, model_path
    [task]                      # name, params, dataset_size
    [rollout]                   # prompts_per_step, samples_per_prompt, max_new_tokens, temperature,
                                # strategy, instances, engine, mode, block_size
    [optimizer]                 # lr, max_grad_norm, updates_per_rollout
    [loss]                      # clip_eps, kl_coef, aggregation, ref_sync_every
    [packing]                   # enabled, max_len, max_count, micro_batch_size
    [parallel]                  # optimizer_shard, tp, pp, pipeline_schedule
    [checkpoint]                # dir, every, keep

The sections are the dataclasses of config_sections.py, each checking its own fields. Keys may
also be dotted (``"optimizer.lr"``, as ``--set`` takes them) or carry the flat names of ms-rlhf's
first configs (``"lr"``), which checkpoints of earlier versions store (config_keys.py). Unknown
keys, a key given twice and bad values raise RLHFError naming them as ``section.field``, so a typo
never silently falls back to a default. :meth:`TrainConfig.to_dict` (nested) is what checkpoints
store.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ms_layout.files import FileError, read_capped

from .config_keys import canonical, show
from .config_sections import (
    CheckpointConfig,
    LossConfig,
    OptimizerConfig,
    PackingConfig,
    ParallelismConfig,
    RolloutConfig,
    TaskConfig,
    check_bool,
    check_int,
    check_path,
)
from .errors import RLHFError
from .limits import MAX_CONFIG_BYTES, MAX_MODEL_DIM

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

SECTIONS = {
    "task": TaskConfig,
    "rollout": RolloutConfig,
    "optimizer": OptimizerConfig,
    "loss": LossConfig,
    "packing": PackingConfig,
    "parallel": ParallelismConfig,
    "checkpoint": CheckpointConfig,
}
"""{section name: its dataclass}, in the order a config file lists them."""


@dataclass
class TrainConfig:
    """Everything a GRPO run needs: run-wide keys, then one section per concern."""

    seed: int = 0
    """Seeds the model init, the dataset, the sampler and every rollout sample."""
    steps: int = 40
    """Rollout + update steps to run."""
    jit: bool = True
    """Compile log-probs, loss and gradients with mindspore.jit (rows padded to one width: packing.max_len
    when packing, else the longest prompt + max_new_tokens); false: eager, the debug path. A
    tensor-parallel actor (tp > 1) runs eagerly either way (its collectives run on the host)."""
    model: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_MODEL))
    """ms_models tiny_config arch and field overrides (vocab_size comes from the task's tokenizer)."""
    model_path: str | None = None
    """Start from this ms_models checkpoint directory instead (its vocabulary must cover the task's)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The verifiable task and its prompt set."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout sizes, sampling and the inference engine."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Adam and the updates per rollout."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The GRPO loss terms and the reference model's refresh."""
    packing: PackingConfig = field(default_factory=PackingConfig)
    """Packs or padded rows, and micro-batches."""
    parallel: ParallelismConfig = field(default_factory=ParallelismConfig)
    """ZeRO, tensor and pipeline parallelism of the training model."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint directory, interval and retention."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise RLHFError on a value that cannot run (a wrong type, out of range, over a limit)."""
        for name, cls in SECTIONS.items():
            section = getattr(self, name)
            if not isinstance(section, cls):
                raise RLHFError(
                    f"config {name}={show(section)}: expected a {cls.__name__} (or use TrainConfig.from_dict)"
                )
            section.validate()
        check_int(self.seed, "seed", 0)
        check_int(self.steps, "steps", 1)
        check_bool(self.jit, "jit")
        check_path(self.model_path, "model_path")
        _check_model(self.model)
        samples = self.rollout.prompts_per_step * self.rollout.samples_per_prompt
        if samples % self.optimizer.updates_per_rollout:
            raise RLHFError(f"config optimizer.updates_per_rollout={self.optimizer.updates_per_rollout} must divide "
                            f"the {samples} samples of a rollout (prompts_per_step * samples_per_prompt)")  # fmt: skip
        par = self.parallel
        if par.pp > 1 and (self.packing.enabled or par.tp > 1):
            raise RLHFError(
                f"config parallel.pp={par.pp} needs packing.enabled=false and parallel.tp=1 (pipeline blocks see "
                f"each row as one causal sequence; got packing.enabled={self.packing.enabled}, parallel.tp={par.tp})"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain nested data (JSON-able): run-wide keys, then an object per section."""
        return asdict(self)

    def dotted(self) -> dict[str, Any]:
        """``{key: value}`` with section fields as ``"section.field"`` (run-wide keys as they are)."""
        return canonical(self.to_dict(), _FIELDS, _TOP)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """Build from plain data: nested sections, dotted keys or the flat names of earlier configs
        (config_keys.py), mixed as you like; an unknown key or one given twice is an error naming it."""
        values = dotted_keys(data)
        parts: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        top = {}
        for key, value in values.items():
            section, _, name = key.partition(".")
            if name:
                parts[section][name] = value
            else:
                top[key] = value
        return cls(**top, **{name: SECTIONS[name](**part) for name, part in parts.items()})

    def updated(self, changes: Mapping[str, Any]) -> TrainConfig:
        """A copy with `changes` (in any spelling from_dict reads) replacing this config's values."""
        return TrainConfig.from_dict({**self.dotted(), **dotted_keys(changes)})


_TOP = tuple(f.name for f in fields(TrainConfig) if f.name not in SECTIONS)
_FIELDS = {name: tuple(f.name for f in fields(cls)) for name, cls in SECTIONS.items()}


def dotted_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """``{"section.field" or run-wide key: value}`` of config data in any spelling (not validated)."""
    return canonical(data, _FIELDS, _TOP)


def load_config(path: str | os.PathLike, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """Read a TrainConfig from a .json or .toml file, then apply `overrides` (``--set``: dotted or
    flat keys), which replace the file's values however either spells them."""
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
    return TrainConfig.from_dict({**dotted_keys(data), **dotted_keys(overrides or {})})


def _check_model(model: Any) -> None:
    """The `model` overrides: an object of plain values, integers within MS_RLHF_MAX_MODEL_DIM."""
    if not isinstance(model, dict):
        raise RLHFError(f"config model={show(model)}: expected an object of ms_models config fields")
    if not isinstance(model.get("arch", "llama"), str):
        raise RLHFError(f"config model.arch={show(model['arch'])}: expected a name such as 'llama'")
    for key, value in model.items():
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 0:
                raise RLHFError(f"config model.{key}={value}: expected an int >= 0")
            MAX_MODEL_DIM.check(value, f"config model.{key}", RLHFError)
        elif value is not None and not isinstance(value, (bool, float, str)):
            raise RLHFError(f"config model.{key}={show(value)}: expected a number, a string, true/false or null")
