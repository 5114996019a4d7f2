"""ms-recompute report: JSON numbers equal the API's, the plan file loads, errors exit 2."""

from __future__ import annotations

import json

import pytest

from ms_recompute import RecomputePlan, Shape, model_memory
from ms_recompute.cli import main, parse_bytes

CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}


@pytest.fixture
def config_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def test_report_json_matches_the_formula_and_saves_the_plan(config_dir, capsys):
    out = config_dir / "plan.msgpack"
    argv = [
        "report",
        "--config",
        str(config_dir),
        "--batch",
        "2",
        "--seq",
        "128",
        "--dtype",
        "float32",
        "--comm-ms",
        "1",
    ]
    assert main([*argv, "--budget", "16MiB", "--overlap", "--json", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    layers = model_memory(CONFIG, Shape(2, 128))
    assert report["without_plan"]["kept_bytes"] == sum(m.total_bytes for m in layers)
    assert report["full_recompute"]["kept_bytes"] == sum(m.input_bytes for m in layers)
    # a plan is never slower than recomputing everything when everything fits
    assert report["plan"]["recompute_s"] <= report["full_recompute"]["recompute_s"] or (
        report["full_recompute"]["peak_bytes"] > 16 << 20
    )
    assert report["plan"]["peak_bytes"] <= 16 << 20 < report["without_plan"]["kept_bytes"]
    plan = RecomputePlan.load(out)
    assert plan.spec == report["plan"]["spec"] and plan.overlap
    assert report["plan"]["groups"] == [str(g) for g in plan.groups]
    assert main([*argv, "--budget", "16MiB"]) == 0
    text = capsys.readouterr().out
    assert "without recompute" in text and "plan spec" in text


def test_errors_exit_2_with_the_reason(config_dir, tmp_path, capsys):
    assert main(["report", "--config", str(config_dir), "--budget", "10"]) == 2
    assert "below the lowest peak" in capsys.readouterr().err
    assert main(["report", "--config", str(config_dir), "--arch", "llama", "--budget", "1GiB"]) == 2
    assert "model_type 'qwen2'" in capsys.readouterr().err
    assert main(["report", "--config", str(tmp_path / "nowhere"), "--budget", "1GiB"]) == 2
    assert "no config file" in capsys.readouterr().err
    assert main(["report", "--config", str(config_dir), "--budget", "lots"]) == 2


def test_parse_bytes():
    assert parse_bytes("20GiB") == 20 << 30
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("4096") == 4096
