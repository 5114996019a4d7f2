"""Shared fixtures: ms-layout's pytest plugin, and one reference GRPO run other tests compare with."""

from __future__ import annotations

import numpy as np
import pytest

STEPS = 40
CONFIG = {"jit": True, "seed": 0, "steps": STEPS}  # the shipped defaults: "add" with operands 0..4
# (tests add section fields as dotted keys, {**CONFIG, "packing.enabled": False}: TrainConfig.from_dict)

OLD_FLAT_DEFAULTS = {
    "task": "add", "task_params": {"max_operand": 4}, "dataset_size": 1024,
    "model": {"arch": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16},
    "model_path": None, "seed": 0, "steps": 40, "prompts_per_step": 8, "samples_per_prompt": 8, "max_new_tokens": 6,
    "temperature": 1.0, "lr": 0.01, "max_grad_norm": 1.0, "clip_eps": 0.2, "kl_coef": 0.005,
    "loss_aggregation": "seq-mean-token-mean", "updates_per_rollout": 1, "packing": True, "max_pack_len": 64,
    "max_pack_count": None, "micro_batch_size": 4, "rollout_strategy": "uniform", "rollout_instances": 2,
    "rollout_engine": "embedded", "rollout_mode": "auto", "block_size": 8, "optimizer_shard": False, "tp": 1,
    "pp": 1, "pipeline_schedule": "zbv", "ref_sync_every": 0, "checkpoint_dir": None, "checkpoint_every": 0,
    "keep_checkpoints": 2, "jit": True,
}  # fmt: skip
"""`TrainConfig().to_dict()` of ms-rlhf before the nested sections, as its checkpoints and config
files hold it (copied from that version's output)."""
OLD_FLAT_NAMES = {
    "task.name": "task", "task.params": "task_params", "task.dataset_size": "dataset_size",
    "rollout.strategy": "rollout_strategy", "rollout.instances": "rollout_instances",
    "rollout.engine": "rollout_engine", "rollout.mode": "rollout_mode", "loss.aggregation": "loss_aggregation",
    "packing.enabled": "packing", "packing.max_len": "max_pack_len", "packing.max_count": "max_pack_count",
    "checkpoint.dir": "checkpoint_dir", "checkpoint.every": "checkpoint_every", "checkpoint.keep": "keep_checkpoints",
}  # fmt: skip
"""The renamed fields' flat names; any other section field's flat name is its own (``optimizer.lr``: ``lr``)."""


def flat_config(nested: dict) -> dict:
    """A nested config (to_dict) written as the flat dict earlier versions stored."""
    out = {}
    for key, value in nested.items():
        if isinstance(value, dict) and key != "model":
            out.update({OLD_FLAT_NAMES.get(f"{key}.{k}", k): v for k, v in value.items()})
        else:
            out[key] = value
    return out


def flatten_checkpoint_config(path) -> dict:
    """Rewrite a checkpoint's stored config into the flat form of an earlier version (state.json and
    its manifest entry, as that version would have written them); returns the flat config."""
    import json
    import os

    from ms_layout.files import write_manifest

    state_path = os.path.join(path, "state.json")
    with open(state_path) as f:
        state = json.load(f)
    state["config"] = flat_config(state["config"])
    with open(state_path, "w") as f:
        json.dump(state, f, sort_keys=True)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    files = manifest.pop("files")
    write_manifest(path, files, manifest)
    return state["config"]


def pytest_configure(config):
    if not config.pluginmanager.has_plugin("ms_layout"):
        import ms_layout.testing

        config.pluginmanager.register(ms_layout.testing, "ms_layout")


def params(model) -> dict[str, np.ndarray]:
    """Copies of a model's parameters by name."""
    return {n: p.asnumpy().copy() for n, p in model.parameters_and_names()}


def first_moments(trainer) -> dict[str, np.ndarray]:
    """Copies of Adam's first moments by parameter name: after one step, (1 - beta1) times the step's
    (clipped) gradient."""
    prefix = "moment1.master."
    return {
        n[len(prefix) :]: p.asnumpy().copy()
        for n, p in trainer.optimizer.parameters_and_names()
        if n.startswith(prefix)
    }


@pytest.fixture(scope="session")
def reference_run():
    """A 40-step single-process run with snapshots of the three models after steps 1, 2 and 6."""
    import mindspore as ms

    from ms_rlhf import TrainConfig
    from ms_rlhf.runtime.trainer import GRPOTrainer

    ms.set_device("CPU")
    trainer = GRPOTrainer(TrainConfig.from_dict(CONFIG))
    out = {"initial": params(trainer.model), "infer_initial": params(trainer.infer_model),
           "ref_initial": params(trainer.ref_model)}  # fmt: skip
    for step in range(1, STEPS + 1):
        trainer.step()
        if step in (1, 2, 6):
            out[step] = {"train": params(trainer.model), "infer": params(trainer.infer_model),
                         "ref": params(trainer.ref_model), "moment1": first_moments(trainer)}  # fmt: skip
    out["history"] = trainer.history
    return out
