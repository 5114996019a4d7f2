"""Tasks (tokenizer, rewards, prompt stream state) and the config's validation."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest
from conftest import OLD_FLAT_DEFAULTS, flat_config

from ms_rlhf import PromptStream, RLHFError, RolloutConfig, TrainConfig, load_config, make_task


def test_reverse_reward_checks_the_answer_exactly():
    task = make_task("reverse", alphabet="abc", min_len=3, max_len=3)
    tok = task.tokenizer
    prompt = task.sample(np.random.default_rng(0))
    assert prompt.answer == prompt.text[:-1][::-1] and prompt.text.endswith("=")
    right = tok.encode(prompt.answer, bos=False) + [tok.eos_id]
    assert task.reward(prompt, right) == 1.0
    assert task.reward(prompt, right[:-1]) == 0.0  # no </s>: no reward
    assert task.reward(prompt, right[:1] + [tok.eos_id]) == pytest.approx(1 / 3)  # one of three
    assert task.reward(prompt, right[:-1] + right[:1] + [tok.eos_id]) == pytest.approx(3 / 4)  # an extra char


def test_add_task():
    task = make_task("add", max_operand=9)
    prompt = task.sample(np.random.default_rng(3))
    a, b = prompt.text[:-1].split("+")
    assert prompt.answer == str(int(a) + int(b))
    assert task.tokenizer.decode(task.tokenizer.encode(prompt.text)) == prompt.text
    with pytest.raises(RLHFError, match="character 'x'"):
        task.tokenizer.encode("x")
    with pytest.raises(RLHFError, match="unknown task 'sort'"):
        make_task("sort")


def test_prompt_stream_state_round_trips_through_msgpack():
    task = make_task("reverse")
    a = PromptStream(task, seed=5, size=7)
    a.next(10)  # crosses an epoch boundary
    state = msgpack.unpackb(msgpack.packb(a.state()))
    b = PromptStream(task, seed=5, size=7)
    b.load_state(state)
    assert [i for i, _ in a.next(20)] == [i for i, _ in b.next(20)]


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(RLHFError, match=r"unknown config keys \['stepz'\]"):
        TrainConfig.from_dict({"stepz": 3})
    with pytest.raises(RLHFError, match="rollout.prompts_per_step=0"):
        RolloutConfig(prompts_per_step=0)
    with pytest.raises(RLHFError, match="rollout.strategy='zigzag'"):  # a flat name, named as section.field
        TrainConfig.from_dict({"rollout_strategy": "zigzag"})
    with pytest.raises(RLHFError, match=r"config packing=RolloutConfig\(.*expected a PackingConfig"):
        TrainConfig(packing=RolloutConfig())  # a section of the wrong type
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"steps": 3, "task": {"name": "add"}}))
    assert load_config(path).steps == 3
    toml = tmp_path / "c.toml"
    toml.write_text('steps = 4\n[task]\nname = "reverse"\nparams = { alphabet = "ab" }\n[optimizer]\nlr = 0.5\n')
    cfg = load_config(toml)
    assert (cfg.task.name, cfg.task.params, cfg.optimizer.lr) == ("reverse", {"alphabet": "ab"}, 0.5)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    flat = tmp_path / "flat.toml"  # a config file as earlier versions read it
    flat.write_text('steps = 4\ntask = "reverse"\nlr = 0.5\n[task_params]\nalphabet = "ab"\n')
    assert load_config(flat) == cfg


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"parallel.tp": 0}, "parallel.tp=0"),
        ({"pp": True}, "parallel.pp=True"),
        ({"parallel": {"pp": 2}}, "parallel.pp=2 needs packing.enabled=false"),
        ({"parallel.pp": 2, "packing.enabled": False, "parallel.tp": 2}, "parallel.tp=2"),
        ({"pipeline_schedule": ""}, "parallel.pipeline_schedule=''"),
    ],
)
def test_parallel_fields_are_checked_by_name(fields, named):
    with pytest.raises(RLHFError, match=named.replace("(", r"\(")):
        TrainConfig.from_dict(fields)


# every field off its default, nested as to_dict writes it
NESTED = {
    "seed": 3, "steps": 5, "jit": False, "model": {"arch": "llama", "hidden_size": 16}, "model_path": "/m",
    "task": {"name": "reverse", "params": {"alphabet": "ab"}, "dataset_size": 99},
    "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 7, "temperature": 0.7,
                "strategy": "balanced", "instances": 3, "engine": "vllm", "mode": "paged", "block_size": 16},
    "optimizer": {"lr": 0.02, "max_grad_norm": 0.5, "updates_per_rollout": 2},
    "loss": {"clip_eps": 0.3, "kl_coef": 0.01, "aggregation": "token-mean", "ref_sync_every": 4},
    "packing": {"enabled": False, "max_len": 32, "max_count": 3, "micro_batch_size": 2},
    "parallel": {"optimizer_shard": True, "tp": 2, "pp": 1, "pipeline_schedule": "1f1b"},
    "checkpoint": {"dir": "/ck", "every": 2, "keep": 3},
}  # fmt: skip


def test_flat_dotted_and_nested_configs_are_the_same_config():
    default = TrainConfig().dotted()
    changed = {k for k, v in TrainConfig.from_dict(NESTED).dotted().items() if v != default[k]}
    assert changed == set(default) - {"parallel.pp"}  # pp > 1 needs the rest single-process: left at 1
    nested = TrainConfig.from_dict(NESTED)
    assert nested.to_dict() == NESTED  # to_dict writes nested, and reads back the same
    assert TrainConfig.from_dict(flat_config(NESTED)) == nested  # the flat form of earlier checkpoints
    dotted = {}
    for key, value in NESTED.items():
        sub = value.items() if isinstance(value, dict) and key != "model" else None
        dotted.update({f"{key}.{k}": v for k, v in sub} if sub is not None else {key: value})
    assert TrainConfig.from_dict(dotted) == nested and nested.dotted() == dotted
    mixed = {**flat_config({"loss": NESTED["loss"]}), "rollout": NESTED["rollout"], "optimizer.lr": 0.02}
    got = TrainConfig.from_dict(mixed)
    assert (got.loss, got.rollout, got.optimizer.lr) == (nested.loss, nested.rollout, 0.02)
    assert TrainConfig.from_dict(OLD_FLAT_DEFAULTS) == TrainConfig()  # an earlier version's defaults


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"lr": 0.1, "optimizer": {"lr": 0.2}},
            "config optimizer.lr is given twice: as 'lr' and in the optimizer section",
        ),
        ({"optimizer.lr": 0.1, "lr": 0.2}, "config optimizer.lr is given twice: as 'optimizer.lr' and as 'lr'"),
        ({"packing": {"enabled": True}, "packing.enabled": True}, "config packing.enabled is given twice"),
        ({"max_pack_len": 8, "packing": {"max_len": 8}}, "config packing.max_len is given twice"),
        ({"optimizer": {"lrr": 1}}, "unknown config keys ['optimizer.lrr']"),
        ({"optimizer.lrr": 1, "stepz": 2}, "unknown config keys ['optimizer.lrr', 'stepz']"),
        ({"optimizer": 0.1}, "config optimizer=0.1: expected an object of optimizer keys"),
        ([("lr", 1)], "config must be an object (a mapping of keys), got list"),
    ],
)
def test_unknown_and_twice_given_keys_are_errors(data, message):
    with pytest.raises(RLHFError) as info:
        TrainConfig.from_dict(data)
    assert message in str(info.value)


def test_overrides_replace_the_files_values_in_any_spelling(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(NESTED))
    got = load_config(path, {"lr": 0.5, "rollout.temperature": 0.9, "checkpoint": {"keep": 7}})
    assert (got.optimizer.lr, got.rollout.temperature, got.checkpoint.keep) == (0.5, 0.9, 7)
    assert got.optimizer.max_grad_norm == NESTED["optimizer"]["max_grad_norm"]  # the rest of the section stays
    assert got == TrainConfig.from_dict(NESTED).updated(
        {"optimizer.lr": 0.5, "temperature": 0.9, "keep_checkpoints": 7}
    )


def test_resumable_changes_are_config_keys_and_flat_saved_configs_compare():
    from ms_rlhf.runtime.run import RESUMABLE_CHANGES, _check_same_run

    assert RESUMABLE_CHANGES <= set(TrainConfig().dotted())
    ours = TrainConfig.from_dict(NESTED)
    saved = flat_config({**NESTED, "steps": 2, "checkpoint": {"dir": "/old", "every": 1, "keep": 2}})
    _check_same_run(ours, TrainConfig.from_dict({**saved, "tp": 1, "optimizer_shard": False}))  # layouts may change
    with pytest.raises(RLHFError, match=r"differs from the checkpoint's in \['loss.kl_coef', 'optimizer.lr'\]"):
        _check_same_run(ours, TrainConfig.from_dict({**saved, "lr": 0.03, "kl_coef": 0.02}))
