"""The compare exported as MindStudio's graph-visualizer database (`.vis.db`), checked against the
tree that msprobe's own `graph_visualize` builds from the same two dumps."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fakenet import MLPNet, NumpyAdapter

from ms_probe import compare_dirs
from ms_probe.config import DumpConfig
from ms_probe.recorder import Recorder
from ms_probe.vis_db import NODE_COLUMNS, PRECISION, ROOT, write_vis_db


class _AsMindSpore(NumpyAdapter):
    """numpy arrays recorded as MindSpore's: msprobe reads dumps of MindSpore or PyTorch only."""

    framework = "mindspore"
    type_name = "mindspore.Tensor"


def _dump(path: Path, net: MLPNet) -> None:
    rec = Recorder(DumpConfig(dump_path=str(path), task="statistics"), _AsMindSpore(), 0)
    rec.step = 0
    rec.start()
    net.run(rec, np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32))
    rec.stop()


def _dumps(tmp_path: Path) -> tuple[Path, Path]:
    target, golden = tmp_path / "target", tmp_path / "golden"
    _dump(target, MLPNet(scale=1.5))  # the ReLU's output scaled: block.act diverges first
    _dump(golden, MLPNet())
    return target, golden


def _nodes(db_path: Path) -> dict[tuple[str, str], dict]:
    with sqlite3.connect(db_path) as db:
        db.row_factory = sqlite3.Row
        return {(r["graph_id"], r["node_name"]): dict(r) for r in db.execute("SELECT * FROM tb_nodes")}


def test_every_item_is_a_node_of_a_consistent_tree(tmp_path):
    target, golden = _dumps(tmp_path)
    run = compare_dirs(str(target), str(golden))
    path = write_vis_db(run, tmp_path / "vis" / "compare.vis.db")
    with sqlite3.connect(path) as db:
        columns = [r[1] for r in db.execute("PRAGMA table_info(tb_nodes)")]
        (config,) = db.execute("SELECT graph_type, task, rank_list, step_list FROM tb_config").fetchall()
    assert columns == list(NODE_COLUMNS)
    assert config == ("compare", "summary", "[0]", "[0]")
    nodes = _nodes(path)
    rc = run.ranks[0]
    for side, graph in (("target", "NPU_0_0"), ("golden", "Bench_0_0")):
        names = {name for g, name in nodes if g == graph}
        assert names == set(rc.dumps[side].items) | {ROOT}
        for (g, name), node in nodes.items():
            if g != graph:
                continue
            children = json.loads(node["sub_nodes"] or "[]")
            assert all(nodes[(g, c)]["up_node"] == name for c in children), name
            assert all(nodes[(g, c)]["node_order"] < node["node_order"] for c in children), name  # post-order
            assert (node["up_node"] == "") == (name == ROOT)
    last = max(n["node_order"] for (g, _), n in nodes.items() if g == "NPU_0_0")
    assert nodes[("NPU_0_0", ROOT)]["node_order"] == last
    # the verdicts colour the target's nodes; the first divergence is among the non-passing ones
    verdict = {m.name: m.result for m in rc.modules}
    for name, result in verdict.items():
        assert nodes[("NPU_0_0", name)]["precision_index"] == PRECISION.get(result), name
    first = rc.first_divergence
    assert first == "Cell.block.act.ReLU.forward.0" and nodes[("NPU_0_0", first)]["precision_index"] >= 0.45
    link = json.loads(nodes[("NPU_0_0", first)]["matched_node_link"])
    assert link == [ROOT, "Cell.block.MLP.forward.0", first]
    output = json.loads(nodes[("NPU_0_0", first)]["output_data"])
    (record,) = output.values()
    assert record["Result"] in ("warning", "error") and "Max diff" in record and record["shape"] == "[4, 16]"


def test_the_database_is_replaced_whole_and_a_bad_name_is_refused(tmp_path):
    target, golden = _dumps(tmp_path)
    run = compare_dirs(str(target), str(golden))
    path = tmp_path / "compare.vis.db"
    path.write_bytes(b"an older export")
    write_vis_db(run, path)
    assert len(_nodes(path)) == 2 * (len(run.ranks[0].dumps["target"].items) + 1)
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError, match="'.*compare.db'.*vis.db"):
        write_vis_db(run, tmp_path / "compare.db")
    assert not (tmp_path / "compare.db").exists()


def test_a_backward_parent_is_the_callers_backward(tmp_path):
    """A container that is never called (a CellList) is not a backward parent; a caller whose
    backward ran before its child's (its inputs are integer ids) is named by its last backward."""
    rec = Recorder(DumpConfig(dump_path=str(tmp_path), task="statistics"), NumpyAdapter(), 0)
    rec.step = 0
    rec.start()
    x = np.zeros(2, np.float32)
    rec.forward_pre("model", "Model", (x,), {})
    for path, cls in (("model.layers.0", "Layer"), ("model.embed", "Embedding")):
        rec.forward_pre(path, cls, (x,), {})
        rec.forward_post(path, x, [])
    rec.forward_post("model", x, [])
    rec.backward("model.layers.0", "Layer", (x,), (x,), ("model.layers", "CellList"))
    rec.backward("model", "Model", (x,), (x,), None)
    rec.backward("model.embed", "Embedding", (x,), (x,), ("model", "Model"))
    parents = json.loads((Path(rec.stop()) / "construct.json").read_text())
    assert parents["Cell.model.layers.0.Layer.backward.0"] == "Cell.model.Model.backward.0"
    assert parents["Cell.model.embed.Embedding.backward.0"] == "Cell.model.Model.backward.0"


def _msprobe() -> list[str] | None:
    exe = Path(sys.executable).with_name("msprobe")
    return [str(exe)] if exe.exists() else ([shutil.which("msprobe")] if shutil.which("msprobe") else None)


@pytest.mark.needs_mindspore  # msprobe is installed beside the frameworks; it reads these as MindSpore dumps
def test_the_tree_equals_msprobes_own_graph_visualize(tmp_path):
    """msprobe 26.2.0 (`mindstudio-probe`) reads ms-probe's dumps and builds its compare graph: the
    nodes, parents, children, order and cross-graph links of ours are the same."""
    msprobe = _msprobe()
    if msprobe is None:
        pytest.skip("msprobe (pip install mindstudio-probe) is not installed")
    target, golden = _dumps(tmp_path)
    out = tmp_path / "msprobe"
    proc = subprocess.run(
        [*msprobe, "graph_visualize", "-tp", str(target / "step0" / "rank0"), "-gp", str(golden / "step0" / "rank0"),
         "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    found = list(out.glob("*.vis.db"))
    assert len(found) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    theirs = found[0]
    ours = _nodes(write_vis_db(compare_dirs(str(target), str(golden)), tmp_path / "ours.vis.db"))
    reference = _nodes(theirs)
    assert set(ours) == set(reference)
    keys = ("up_node", "sub_nodes", "node_order", "node_type", "matched_node_link", "micro_step_id")
    differ = [(k, key) for k in ours for key in keys if ours[k][key] != reference[k][key]]
    assert not differ, differ[:5]
    with sqlite3.connect(theirs) as db:
        assert [r[1] for r in db.execute("PRAGMA table_info(tb_nodes)")] == list(NODE_COLUMNS)
