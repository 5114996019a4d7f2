"""How a config key may be spelled: nested, dotted, or by its flat name from ms-rlhf's first configs.

One setting, three spellings, all read by :func:`canonical`::

    {"optimizer": {"lr": 0.01}}     nested: a TOML table / JSON object per section (what to_dict writes)
    {"optimizer.lr": 0.01}          dotted: what ``ms-rlhf train --set optimizer.lr=0.01`` passes
    {"lr": 0.01}                    flat: the first configs' one-level names (FLAT_KEYS)

The flat names stay readable because checkpoints written by earlier versions store their config in
that form (a resumed run compares against it) and because existing config files use it. A key
no spelling knows, or one setting given twice (``"lr"`` beside ``"optimizer": {"lr": ...}``), is an
RLHFError naming it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from .errors import RLHFError

FLAT_KEYS = {
    "task": "task.name",
    "task_params": "task.params",
    "dataset_size": "task.dataset_size",
    "prompts_per_step": "rollout.prompts_per_step",
    "samples_per_prompt": "rollout.samples_per_prompt",
    "max_new_tokens": "rollout.max_new_tokens",
    "temperature": "rollout.temperature",
    "rollout_strategy": "rollout.strategy",
    "rollout_instances": "rollout.instances",
    "rollout_engine": "rollout.engine",
    "rollout_mode": "rollout.mode",
    "block_size": "rollout.block_size",
    "lr": "optimizer.lr",
    "max_grad_norm": "optimizer.max_grad_norm",
    "updates_per_rollout": "optimizer.updates_per_rollout",
    "clip_eps": "loss.clip_eps",
    "kl_coef": "loss.kl_coef",
    "loss_aggregation": "loss.aggregation",
    "ref_sync_every": "loss.ref_sync_every",
    "packing": "packing.enabled",
    "max_pack_len": "packing.max_len",
    "max_pack_count": "packing.max_count",
    "micro_batch_size": "packing.micro_batch_size",
    "optimizer_shard": "parallel.optimizer_shard",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "pipeline_schedule": "parallel.pipeline_schedule",
    "checkpoint_dir": "checkpoint.dir",
    "checkpoint_every": "checkpoint.every",
    "keep_checkpoints": "checkpoint.keep",
}
"""{flat name of ms-rlhf's first configs: its dotted name now}; run-wide keys (seed, steps, jit,
model, model_path) are spelled the same in every form."""


def canonical(data: Any, sections: Mapping[str, Collection[str]], top: Collection[str]) -> dict[str, Any]:
    """``{dotted key: value}`` of a config in any mix of spellings: run-wide keys as they are,
    section fields as ``"section.field"``. `sections` maps each section to its fields, `top` lists
    the run-wide keys. A mapping under a section's name is that section (the flat ``task`` and
    ``packing`` were a string and a bool, so their old values never read as one)."""
    if not isinstance(data, Mapping):
        raise RLHFError(f"config must be an object (a mapping of keys), got {type(data).__name__}")
    out: dict[str, Any] = {}
    written: dict[str, str] = {}  # dotted key -> how it was spelled, for the "given twice" error
    unknown: list[Any] = []

    def put(key: str, value: Any, how: str) -> None:
        if key in written:
            raise RLHFError(f"config {key} is given twice: {written[key]} and {how}")
        out[key], written[key] = value, how

    for key, value in data.items():
        section, dot, name = key.partition(".") if isinstance(key, str) else (None, "", None)
        if key in sections and isinstance(value, Mapping):
            for sub, sub_value in value.items():
                if isinstance(sub, str) and sub in sections[key]:
                    put(f"{key}.{sub}", sub_value, f"in the {key} section")
                else:
                    unknown.append(f"{key}.{sub}")
        elif key in top:
            put(key, value, f"as {key!r}")
        elif key in FLAT_KEYS:
            put(FLAT_KEYS[key], value, f"as {key!r}")
        elif dot and section in sections and name in sections[section]:
            put(key, value, f"as {key!r}")
        elif key in sections:
            raise RLHFError(f"config {key}={show(value)}: expected an object of {key} keys {sorted(sections[key])}")
        else:
            unknown.append(key)
    if unknown:
        known = sorted([*top, *(f"{s}.{f}" for s, names in sections.items() for f in names)])
        raise RLHFError(
            f"unknown config keys {sorted(unknown, key=str)}; known keys: {known} (or a section's keys under "
            "its name, or the flat names of earlier configs)"
        )
    return out


def show(value: Any) -> str:
    """A value for an error message: its repr, cut short."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**100 else f"<int of {len(str(value))} digits>"
    return text if len(text) <= 80 else text[:77] + "..."
