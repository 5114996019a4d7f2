"""The ms-pipeline console script."""

from __future__ import annotations

import json

import pytest

import ms_pipeline as mp
from ms_pipeline.cli import main


def test_simulate_json_keys(capsys):
    assert main(["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["makespan"] == pytest.approx(33.0)
    assert out["bubble_rate"] == pytest.approx(3 / 11)
    assert out["peak_activation"] == [4.0, 3.0, 2.0, 1.0]


def test_simulate_zbv_uses_the_same_model_split_in_two(capsys):
    assert main(["simulate", "--schedule", "zbv", "--stages", "4", "--microbatches", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["makespan"] == pytest.approx(25.5) and out["bubble_rate_zb"] == pytest.approx(0.0)
    assert out["peak_activation"] == [4.0, 4.0, 4.0, 4.0]  # the same as 1F1B's rank 0


def test_simulate_adaptive_zbv(capsys):
    args = ["simulate", "--schedule", "zbv-adaptive", "--stages", "4", "--microbatches", "4", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] == pytest.approx(13.5)  # fixed pattern: 15
    assert main([*args, "--profile", "zb"]) == 0


def test_simulate_costs_and_profile(capsys):
    args = ["simulate", "--schedule", "zbh1", "--stages", "4", "--microbatches", "8", "--json"]
    assert main([*args, "--costs", "f=1,b=1,w=0.5,comm=0"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] == pytest.approx(8 * 2.5 + 3 * 1.5)
    assert main([*args, "--profile", "zb"]) == 0
    zb = mp.simulate(mp.build("zbh1", 4, 8), mp.CostModel.zb_profile())
    assert json.loads(capsys.readouterr().out)["bubble_rate"] == pytest.approx(zb.bubble_rate)
    assert main(["simulate", "--schedule", "zbh1", "--stages", "4", "--microbatches", "8"]) == 0
    assert "bubble_rate" in capsys.readouterr().out


def test_draw_show_validate(tmp_path, capsys):
    png, trace = tmp_path / "z.png", tmp_path / "z.json"
    assert (
        main(
            ["draw", "--schedule", "zbv", "--stages", "2", "--microbatches", "4", "-o", str(png), "--trace", str(trace)]
        )
        == 0
    )
    assert png.read_bytes()[:4] == b"\x89PNG" and json.loads(trace.read_text())["traceEvents"]
    capsys.readouterr()
    assert main(["show", "--schedule", "zbv", "--stages", "2", "--microbatches", "4", "--csv"]) == 0
    csv_file = tmp_path / "zbv.csv"
    csv_file.write_text(capsys.readouterr().out)
    assert main(["validate", str(csv_file)]) == 0
    assert "ok: schedule custom: stages=4 microbatches=4 placement=0,1,1,0" in capsys.readouterr().out


def test_errors_exit_2_naming_the_problem(tmp_path, capsys):
    assert main(["simulate", "--schedule", "1f1b", "--stages", "0", "--microbatches", "8"]) == 2
    assert "num_ranks must be an int >= 1, got 0" in capsys.readouterr().err
    assert main(["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--costs", "f=x"]) == 2
    assert "cost f='x' is not a number" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("0BW0,0F0\n1F0,1BW0\n")
    assert main(["validate", str(bad)]) == 2
    assert "0BW0 needs 0F0" in capsys.readouterr().err


@pytest.mark.needs_mindspore
@pytest.mark.needs_torch
@pytest.mark.timeout(900)
def test_run_on_two_local_ranks(capsys):
    pytest.importorskip("mindspore")
    assert main(["run", "--schedule", "zbh1", "--stages", "2", "--microbatches", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["matches_reference"] is True and report["max_grad_rel_error"] <= report["rtol"] < 1e-4
    assert report["loss"] == pytest.approx(report["reference_loss"], abs=1e-5)
    # the trace obeys the schedule, so the same durations with free transfers idle no more
    assert report["trace_problems"] == []
    assert report["replayed_bubble_rate"] <= report["measured_bubble_rate"] + 1e-3
