"""The ms-rlhf command: pack, config errors, a short training run with --json."""

from __future__ import annotations

import json

import pytest

from ms_rlhf.cli import main


def test_pack_command(capsys):
    assert main(["pack", "--lengths", "5,3,8,2,7,1", "--max-pack-len", "10", "--max-pack-count", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["packs"] == [[0, 5], [1, 4], [2, 3]] and out["optimal"]


def test_bad_config_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"stepz": 2}))
    assert main(["train", "--config", str(path)]) == 2
    assert "unknown config keys ['stepz']" in capsys.readouterr().err
    assert main(["pack", "--lengths", "4,12", "--max-pack-len", "10"]) == 2
    assert "sample 1 has 12 tokens" in capsys.readouterr().err


@pytest.mark.needs_mindspore
def test_train_two_steps_json(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"steps": 2, "jit": True, "prompts_per_step": 2, "samples_per_prompt": 4}))
    assert main(["train", "--config", str(path), "--json", "--no-progress", "--set", "seed=3"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 2 and len(summary["rewards"]) == 2
    assert {"reward", "loss", "kl", "tokens_per_s"} <= set(summary["last"])
