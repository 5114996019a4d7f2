"""Dumps of a pipelined step (PrecisionDebugger.pipeline_pass, merge.py) without a framework: a
numpy network of two stages on two "ranks" (two Recorders), its passes run in a pipeline's order,
merged and compared with the same network's single-process step over the same microbatches."""

import json
import os
import sqlite3

import numpy as np
import pytest
from fakenet import NumpyAdapter

from ms_probe import DumpConfig, PrecisionDebugger, ProbeError, compare_dirs, load_rank, write_results
from ms_probe.cli import main
from ms_probe.merge import merge_ranks
from ms_probe.recorder import Recorder

M = 3  # microbatches


class TwoStageNet:
    """Stage 0: fc (weight w); stage 1: scale (weight s * k, `k` the planted bug). Each call
    records a forward item; each backward call a module gradient and its parameter gradient."""

    def __init__(self, k: float = 1.0):
        rng = np.random.default_rng(0)
        self.w = rng.normal(0, 0.3, (6, 4)).astype(np.float32)
        self.s = np.float32(0.5) * np.float32(k)
        self.xs = [rng.normal(size=(2, 4)).astype(np.float32) for _ in range(M)]

    def forward(self, rec: Recorder, stage: int, x):
        path, cls, fn, param = (
            ("fc", "Dense", lambda a: a @ self.w.T, ("weight", self.w))
            if stage == 0
            else ("scale", "Scale", lambda a: a * self.s, ("weight", np.asarray(self.s)))
        )
        rec.forward_pre(path, cls, (x,), {})
        out = fn(x)
        rec.forward_post(path, out, [param])
        return out

    def backward(self, rec: Recorder, stage: int, x, g, weights: bool = True):
        if stage == 1:
            rec.backward("scale", "Scale", (g * self.s,), (g,), None)
            if weights:
                rec.param_grad("scale", "Scale", "weight", np.asarray((g * x).sum()), 1)
            return g * self.s
        rec.backward("fc", "Dense", (g @ self.w,), (g,), None)
        if weights:
            rec.param_grad("fc", "Dense", "weight", g.T @ x, 1)
        return g @ self.w


def _recorder(path, rank):
    rec = Recorder(DumpConfig(dump_path=str(path), task="tensor"), NumpyAdapter(), rank)
    rec.start()
    return rec


def single_process(path, net):
    rec = _recorder(path, 0)
    for x in net.xs:
        h = net.forward(rec, 0, x)
        y = net.forward(rec, 1, h)
        g = net.backward(rec, 1, h, np.ones_like(y))
        net.backward(rec, 0, x, g)
    return rec.stop()


def pipelined(path, net):
    """Rank 0 holds stage 0, rank 1 stage 1. B re-runs the forward (a replay) and computes the
    input gradient only; W re-runs it again and differentiates for the weights (its module
    gradients repeat B's); stage 0's B has no input gradient to compute, so its W is the only
    backward. The ranks' passes interleave as a 1F1B schedule would run them."""
    ranks = [_recorder(path, 0), _recorder(path, 1)]
    debuggers = [PrecisionDebugger(dump_path=str(path)) for _ in ranks]
    for d, rec in zip(debuggers, ranks):
        d._recorder = rec
    hs, gs = {}, {}

    def run(stage, mb, kind):
        rec, debugger = ranks[stage], debuggers[stage]
        with debugger.pipeline_pass(stage, mb, kind):
            x = net.xs[mb] if stage == 0 else hs[mb]
            if kind == "F":
                out = net.forward(rec, stage, x)
                if stage == 0:
                    hs[mb] = out
                return
            net.forward(rec, stage, x)  # the replay inside ms.grad
            if stage == 1:
                g = np.ones_like(net.forward(rec, 1, x))
                gs[mb] = net.backward(rec, 1, x, g, weights=kind == "BW") if kind != "W" else None
                if kind == "W":
                    net.backward(rec, 1, x, g)
            elif kind == "W":
                net.backward(rec, 0, x, gs[mb])

    for mb in range(M):
        run(0, mb, "F")
    for mb in range(M):
        run(1, mb, "F")
        run(1, mb, "B")
        run(0, mb, "W")
        run(1, mb, "W")
    return [rec.stop() for rec in ranks]


def test_merged_pipelined_dump_compares_clean_and_names_the_pass(tmp_path):
    golden = single_process(tmp_path / "golden", TwoStageNet())
    folders = pipelined(tmp_path / "pipe", TwoStageNet())
    assert os.path.exists(os.path.join(folders[1], "pipeline.json"))
    where = json.load(open(os.path.join(folders[1], "pipeline.json")))
    assert where["Cell.scale.Scale.backward.2"] == {"stage": 1, "microbatch": 2, "pass": "B"}
    assert where["Cell.scale.Scale.parameters_grad.1"] == {"stage": 1, "microbatch": 1, "pass": "W"}

    merged = merge_ranks([load_rank(f) for f in folders])
    assert merged.ranks == [0, 1] and not merged.damage
    order = list(merged.items)
    # forward by (microbatch, stage), backward by (microbatch, last stage first)
    assert order.index("Cell.fc.Dense.forward.1") < order.index("Cell.scale.Scale.forward.1")
    assert order.index("Cell.scale.Scale.backward.0") < order.index("Cell.fc.Dense.backward.0")
    assert merged.items["Cell.fc.Dense.backward.0"].where == {"stage": 0, "microbatch": 0, "pass": "W"}

    run = compare_dirs(str(tmp_path / "pipe"), str(golden).rsplit("/step", 1)[0], merge_target_ranks=True)
    summary = run.summary()
    assert summary["first_divergence"] is None and summary["target_only"] == summary["golden_only"] == 0, summary
    assert summary["aligned_items"] == 6 * M  # 2 forwards, 2 backwards, 2 parameter gradients per microbatch
    # the graph-visualizer export shows each item under its microbatch (msprobe's micro steps)
    files = write_results(run, tmp_path / "cmp")
    with sqlite3.connect(files["compare.vis.db"]) as db:
        micro = dict(db.execute("SELECT node_name, micro_step_id FROM tb_nodes WHERE graph_id = 'NPU_0_0'"))
        golden_micro = dict(db.execute("SELECT node_name, micro_step_id FROM tb_nodes WHERE graph_id = 'Bench_0_0'"))
        (micro_steps,) = db.execute("SELECT micro_steps FROM tb_config").fetchone()
    assert micro_steps == M and micro["Cell.scale.Scale.backward.2"] == 2 and micro["Cell.fc.Dense.forward.1"] == 1
    assert golden_micro["Cell.scale.Scale.backward.2"] == 2  # the golden's items sit in their counterparts' micro steps

    pipelined(tmp_path / "bad", TwoStageNet(k=1.05))
    bad = compare_dirs(str(tmp_path / "bad"), str(golden).rsplit("/step", 1)[0], merge_target_ranks=True).summary()
    assert bad["first_divergence"] == "Cell.scale.Scale.forward.0", bad
    assert bad["first_divergence_where"] == {"stage": 1, "microbatch": 0, "pass": "F"}


def test_bad_pipeline_input_is_named(tmp_path):
    debugger = PrecisionDebugger(dump_path=str(tmp_path))
    with pytest.raises(ProbeError, match="'X'"):
        with debugger.pipeline_pass(0, 0, "X"):
            pass
    with pytest.raises(ProbeError, match="microbatch must be an int >= 0, got -1"):
        with debugger.pipeline_pass(0, -1, "F"):
            pass
    with pytest.raises(ProbeError, match="no rank dumps"):
        merge_ranks([])
    golden = single_process(tmp_path / "golden", TwoStageNet())
    pipelined(tmp_path / "pipe", TwoStageNet())
    # a golden with two rank folders: which one to compare the merged step with is not known
    two = tmp_path / "two" / "step0"
    os.makedirs(two)
    os.symlink(golden, two / "rank0")
    os.symlink(golden, two / "rank1")
    with pytest.raises(ProbeError, match="has 2 rank folders"):
        compare_dirs(str(tmp_path / "pipe"), str(tmp_path / "two"), merge_target_ranks=True)
    # a damaged pipeline.json value is reported, not trusted
    folder = os.path.join(tmp_path, "pipe", "step0", "rank1")
    path = os.path.join(folder, "pipeline.json")
    doc = json.load(open(path))
    doc["Cell.scale.Scale.forward.0"] = {"stage": -1, "microbatch": 0, "pass": "F"}
    open(path, "w").write(json.dumps(doc))
    dump = load_rank(folder)
    assert any("pipeline.json" in d for d in dump.damage), dump.damage


def test_cli_compares_a_pipelined_step(tmp_path, capsys):
    single_process(tmp_path / "golden", TwoStageNet())
    pipelined(tmp_path / "bad", TwoStageNet(k=1.05))
    args = ["compare", "--target", str(tmp_path / "bad"), "--golden", str(tmp_path / "golden"), "--out"]
    assert main([*args, str(tmp_path / "out"), "--pipeline", "--no-html"]) == 0
    text = capsys.readouterr().out
    assert "first divergence: Cell.scale.Scale.forward.0" in text and "in stage 1, microbatch 0, pass F" in text
    assert main([*args, str(tmp_path / "out2"), "--pipeline", "--rank", "0"]) == 2
    assert "takes no --rank" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()
