"""Dump -> read -> compare -> report without any framework: a numpy network through the real
Recorder and writer. Damaged files, missing items and mismatched ranks included."""

import json
import os
import shutil

import numpy as np
import pytest
from conftest import screenshot
from fakenet import MLPNet, dump_fake

from ms_probe import ProbeError, auto_align, compare_dirs, load_rank, mapping_from_dict
from ms_probe.cli import main


def test_layout_names_and_manifest(tmp_path):
    folder = dump_fake(tmp_path / "d", MLPNet(), task="tensor", step=3, rank=1)
    assert folder == str(tmp_path / "d" / "step3" / "rank1")
    names = sorted(os.listdir(folder))
    assert names == ["construct.json", "dump.json", "dump_tensor_data", "manifest.json", "stack.json"]
    dump = json.load(open(os.path.join(folder, "dump.json")))
    assert (dump["task"], dump["level"], dump["framework"]) == ("tensor", "L0", "numpy")
    assert dump["dump_data_dir"].endswith("dump_tensor_data")
    # Children complete before their parent, as msprobe writes them.
    assert list(dump["data"])[:5] == [
        "Cell.block.fc1.Dense.forward.0",
        "Cell.block.act.ReLU.forward.0",
        "Cell.block.fc2.Dense.forward.0",
        "Cell.block.MLP.forward.0",
        "Cell.norm.Norm.forward.0",
    ]
    fc1 = dump["data"]["Cell.block.fc1.Dense.forward.0"]
    assert fc1["input_args"][0]["data_name"] == "Cell.block.fc1.Dense.forward.0.input.0.npy"
    assert set(fc1["parameters"]) == {"weight"} and fc1["output"][0]["shape"] == [4, 16]
    assert "Cell.block.fc2.Dense.parameters_grad.0" in dump["data"]
    construct = json.load(open(os.path.join(folder, "construct.json")))
    assert construct["Cell.block.fc1.Dense.forward.0"] == "Cell.block.MLP.forward.0"
    assert construct["Cell.block.MLP.forward.0"] is None
    assert construct["Cell.block.fc2.Dense.backward.0"] == "Cell.block.MLP.backward.0"
    stacks = json.load(open(os.path.join(folder, "stack.json")))
    assert all(isinstance(v[0], list) and isinstance(v[1], list) for v in stacks.values())
    arr = np.load(os.path.join(folder, "dump_tensor_data", "Cell.block.fc1.Dense.forward.0.output.0.npy"))
    assert arr.shape == (4, 16)
    assert not [n for n in os.listdir(os.path.join(folder, "dump_tensor_data")) if "tmp" in n]


def test_filters_list_scope_steps_and_data_mode(tmp_path):
    d = json.load(open(os.path.join(dump_fake(tmp_path / "a", MLPNet(), list=["fc"]), "dump.json")))["data"]
    assert all("fc" in k for k in d) and "Cell.block.fc1.Dense.forward.0" in d
    scope = ["Cell.block.act.ReLU.forward.0", "Cell.norm.Norm.forward.0"]
    d = json.load(open(os.path.join(dump_fake(tmp_path / "b", MLPNet(), scope=scope), "dump.json")))["data"]
    assert list(d) == ["Cell.block.act.ReLU.forward.0", "Cell.block.fc2.Dense.forward.0", "Cell.norm.Norm.forward.0"]
    d = json.load(open(os.path.join(dump_fake(tmp_path / "c", MLPNet(), data_mode=["forward", "output"]), "dump.json")))
    assert all(".forward." in k for k in d["data"])
    assert all("input_args" not in v and "output" in v for v in d["data"].values())
    assert dump_fake(tmp_path / "e", MLPNet(), step=1, **{"step_list": None} if False else {}) is not None
    from fakenet import NumpyAdapter

    from ms_probe.config import DumpConfig
    from ms_probe.recorder import Recorder

    rec = Recorder(DumpConfig(dump_path=str(tmp_path / "f"), step=[1]), NumpyAdapter(), 0)
    rec.start()
    MLPNet().run(rec, np.ones((2, 8), np.float32))
    assert rec.stop() is None  # step 0 is not selected: nothing written
    rec.next_step()
    rec.start()
    MLPNet().run(rec, np.ones((2, 8), np.float32))
    assert rec.stop().endswith(os.path.join("step1", "rank0"))
    assert not (tmp_path / "f" / "step0").exists()


def _pair(tmp_path, task, scale=1.0, **kw):
    t = dump_fake(tmp_path / "t", MLPNet(scale=scale), task=task, **kw)
    g = dump_fake(tmp_path / "g", MLPNet(), task=task, prefix="Module", **kw)
    return t, g


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_same_network_passes_and_bug_is_located(tmp_path, task):
    t, g = _pair(tmp_path / "ok", task)
    run = compare_dirs(t, g)
    rc = run.ranks[0]
    assert rc.mode == task and rc.first_divergence is None
    assert {m.result for m in rc.modules} == {"pass"} and not rc.golden_only
    t, g = _pair(tmp_path / "bug", task, scale=1.3)
    rc = compare_dirs(t, g).ranks[0]
    assert rc.first_divergence == "Cell.block.act.ReLU.forward.0"
    assert next(m for m in rc.modules if m.name == "Cell.block.fc2.Dense.forward.0").source is False


def test_damaged_files_are_reported_and_the_rest_compared(tmp_path):
    t, g = _pair(tmp_path, "tensor", scale=1.3)
    data = os.path.join(t, "dump_tensor_data")
    victim = os.path.join(data, "Cell.block.fc2.Dense.forward.0.output.0.npy")
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    os.remove(os.path.join(data, "Cell.norm.Norm.forward.0.output.0.npy"))
    text = open(os.path.join(t, "dump.json")).read()
    open(os.path.join(t, "dump.json"), "w").write(text[: int(len(text) * 0.6)])
    dump = load_rank(t)
    assert any("dump.json" in p and "truncated" in p for p in dump.problems)
    assert 0 < len(dump.items) < 9
    rc = compare_dirs(t, g).ranks[0]
    assert rc.first_divergence == "Cell.block.act.ReLU.forward.0"  # intact items still locate the bug
    joined = "\n".join(rc.problems)
    assert "Cell.block.fc2.Dense.forward.0.output.0.npy" in joined and "truncated" in joined
    assert "Cell.norm.Norm.forward.0.output.0.npy: missing" in joined or len(dump.items) < 5
    row = next(r for r in rc.rows if r.target == "Cell.block.fc2.Dense.forward.0.output.0")
    assert "statistics compared" in row.message  # fell back to the JSON statistics


def test_missing_items_and_mismatched_ranks(tmp_path):
    dump_fake(tmp_path / "t", MLPNet(), rank=0)
    dump_fake(tmp_path / "t", MLPNet(), rank=1)
    dump_fake(tmp_path / "g", MLPNet(names=("block", "fc1", "act", "fc2", "final_norm")), rank=0, prefix="Module")
    run = compare_dirs(str(tmp_path / "t"), str(tmp_path / "g"))
    assert [(r.step, r.rank) for r in run.ranks] == [(0, 0)]
    assert any("rank 1: only in the target" in p for p in run.problems)
    rc = run.ranks[0]
    missing = [m.name for m in rc.modules if m.result == "unmatched"]
    assert "Cell.norm.Norm.forward.0" in missing
    assert any(n == "Module.final_norm.Norm.forward.0" for n, _ in rc.golden_only)
    with pytest.raises(ProbeError, match="does not exist"):
        compare_dirs(str(tmp_path / "nope"), str(tmp_path / "g"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ProbeError, match="no dump.json"):
        compare_dirs(str(tmp_path / "empty"), str(tmp_path / "g"))


def test_user_mapping_and_auto_alignment(tmp_path):
    names = ("layer", "dense_in", "relu", "dense_out", "ln")
    t = dump_fake(tmp_path / "t", MLPNet(scale=1.3), rank=0)
    g = dump_fake(tmp_path / "g", MLPNet(names=names), rank=0, prefix="Module")
    mapping = mapping_from_dict(
        {
            "modules": [
                {"target": "block.fc1", "golden": "layer.dense_in"},
                {"target": "block.act", "golden": "layer.relu"},
                {"target": "block.fc2", "golden": "layer.dense_out"},
                {"target": "block", "golden": "layer"},
                {"target": "norm", "golden": "ln"},
            ]
        }
    )
    rc = compare_dirs(t, g, mapping).ranks[0]
    assert rc.first_divergence == "Cell.block.act.ReLU.forward.0" and not rc.golden_only
    alignment = auto_align(load_rank(t), load_rank(g))
    pairs = {p.target: p.golden for p in alignment.pairs}
    assert pairs == {"block": "layer", "block.fc1": "layer.dense_in", "block.act": "layer.relu",
                     "block.fc2": "layer.dense_out", "norm": "ln"}  # fmt: skip
    assert 0.5 < alignment.confidence <= 1.0
    rc = compare_dirs(t, g, alignment.to_mapping()).ranks[0]
    assert rc.first_divergence == "Cell.block.act.ReLU.forward.0"


def test_cli_json_and_html_report_screenshot(tmp_path, capsys):
    t, g = _pair(tmp_path, "tensor", scale=1.3)
    out = tmp_path / "out"
    assert main(["compare", "--target", t, "--golden", g, "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["first_divergence"] == "Cell.block.act.ReLU.forward.0"
    assert summary["aligned_items"] == 9 and summary["alignment"]["mapping"] == "identity"
    assert sorted(os.listdir(out)) == [
        "compare.vis.db",  # MindStudio's graph visualizer (test_vis_db.py)
        "compare_result_step0_rank0.csv",
        "compare_result_step0_rank0.json",
        "report.html",
        "summary.json",
    ]
    csv_head = open(out / "compare_result_step0_rank0.csv").readline()
    assert csv_head.startswith(
        "NPU Name,Bench Name,NPU Dtype,Bench Dtype,NPU Tensor Shape,Bench Tensor Shape,"
        "NPU Requires_grad,Bench Requires_grad,Cosine,EucDist,MaxAbsErr,MaxRelativeErr,"
        "One Thousandth Err Ratio,Five Thousandths Err Ratio"
    )
    assert "Requires_grad Consistent,Result,Err_message,NPU_Stack_Info,Data_name" in csv_head
    html = (out / "report.html").read_text()
    assert "FIRST DIVERGENCE" in html and "Cell.block.act.ReLU.forward.0" in html
    assert main(["compare", "--target", t, "--golden", g, "--out", str(out), "--fail-on-divergence"]) == 1
    assert main(["compare", "--target", str(tmp_path / "x"), "--golden", g, "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    png = tmp_path / "report.png"
    screenshot(out / "report.html", png)
    assert png.stat().st_size > 10_000
    shutil.copy(png, os.environ.get("MS_PROBE_SCREENSHOT", tmp_path / "copy.png"))


def test_md5_summary_reports_bit_differences(tmp_path):
    t, g = _pair(tmp_path, "statistics", scale=1.2, summary_mode="md5")
    rc = compare_dirs(t, g).ranks[0]
    fc1 = next(r for r in rc.rows if r.target == "Cell.block.fc1.Dense.forward.0.output.0")
    act = next(r for r in rc.rows if r.target == "Cell.block.act.ReLU.forward.0.output.0")
    assert fc1.metrics["md5_equal"] is True and act.metrics["md5_equal"] is False
    assert "md5 (CRC-32) differs" in act.message


def test_structure_task_writes_the_tree_only(tmp_path):
    folder = dump_fake(tmp_path / "s", MLPNet(), task="structure")
    data = json.load(open(os.path.join(folder, "dump.json")))["data"]
    assert data["Cell.block.fc1.Dense.forward.0"] == {}
    assert (
        json.load(open(os.path.join(folder, "construct.json")))["Cell.block.act.ReLU.forward.0"]
        == "Cell.block.MLP.forward.0"
    )
