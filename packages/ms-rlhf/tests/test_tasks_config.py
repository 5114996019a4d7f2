"""Tasks (tokenizer, rewards, prompt stream state) and the config's validation."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from ms_rlhf import PromptStream, RLHFError, TrainConfig, load_config, make_task


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
    with pytest.raises(RLHFError, match="prompts_per_step=0"):
        TrainConfig(prompts_per_step=0)
    with pytest.raises(RLHFError, match="rollout_strategy='zigzag'"):
        TrainConfig(rollout_strategy="zigzag")
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"steps": 3, "task": "add"}))
    assert load_config(path).steps == 3
    toml = tmp_path / "c.toml"
    toml.write_text('steps = 4\ntask = "reverse"\n[task_params]\nalphabet = "ab"\n')
    cfg = load_config(toml)
    assert cfg.task_params == {"alphabet": "ab"} and TrainConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"tp": 0}, "tp=0"),
        ({"pp": True}, "pp=True"),
        ({"pp": 2}, "pp=2 needs packing=false"),
        ({"pp": 2, "packing": False, "tp": 2}, "tp=2"),
        ({"pipeline_schedule": ""}, "pipeline_schedule=''"),
    ],
)
def test_parallel_fields_are_checked_by_name(fields, named):
    with pytest.raises(RLHFError, match=named.replace("(", r"\(")):
        TrainConfig(**fields)
