"""jit="graph": a compiled training step dumped at module level by probes compiled into its graph,
checked against the PyNative dump of the same step and against a bug planted inside the graph."""

import json
import os

import numpy as np
import pytest

from ms_probe import PrecisionDebugger, compare_dirs

pytestmark = pytest.mark.needs_mindspore

BUGGY = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def ms():
    import mindspore

    mindspore.set_device("CPU")
    return mindspore


def _model():
    import ms_models

    config = ms_models.tiny_config("llama")
    return ms_models.from_config(config, seed=0), config


def _step(ms, model):
    """One training step's loss and gradients, as a plain function (what mindspore.jit compiles)."""
    from mindspore import ops

    grad = ms.value_and_grad(_loss(model, ops), None, model.trainable_params())

    def step(ids, labels):
        return grad(ids, labels)

    return step


def _loss(model, ops):
    def loss(ids, labels):
        logits = model(ids)
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    return loss


def _data(ms, config):
    ids = np.random.default_rng(1).integers(0, config.vocab_size, (2, 9)).astype(np.int32)
    return ms.Tensor(ids[:, :-1]), ms.Tensor(ids[:, 1:])


def _dump(ms, model, folder, jit, task="tensor"):
    ids, labels = _data(ms, model.config)
    dbg = PrecisionDebugger(dump_path=str(folder), task=task, jit=jit)
    step = _step(ms, model)
    dbg.start(model)
    loss, grads = (dbg.jit(step) if jit == "graph" else ms.jit(step))(ids, labels)
    out = dbg.stop()
    dbg.close()
    return out, float(loss.asnumpy()), grads


def _items(folder):
    return json.load(open(os.path.join(folder, "dump.json")))["data"]


def _plant_bug(model):
    """Scale one linear layer's weight inside its construct: the bug lives in the compiled graph."""
    from mindspore import ops

    cell = model
    for part in BUGGY.split("."):
        cell = getattr(cell, part) if not part.isdigit() else cell[int(part)]
    cls = type(cell)

    def construct(self, x):
        return ops.matmul(x, (self.weight * 1.01).T)

    cell.__class__ = type(cls.__name__, (cls,), {"construct": construct})  # same name: same dump items
    return cell


def test_graph_dump_equals_the_pynative_dump_of_the_same_step(ms, tmp_path):
    model, _ = _model()
    graph, loss_g, grads_g = _dump(ms, model, tmp_path / "graph", "graph")
    eager, loss_e, _ = _dump(ms, model, tmp_path / "eager", "pynative")
    assert loss_g == pytest.approx(loss_e, rel=1e-6)
    g_items, e_items = _items(graph), _items(eager)
    # Every Cell the eager dump saw, forward, backward and parameter gradients, is in the graph dump.
    assert set(e_items) <= set(g_items), sorted(set(e_items) - set(g_items))[:5]
    assert any(".backward." in n for n in g_items) and any(".parameters_grad." in n for n in g_items)
    # The values are the step's own: a layer output and a parameter gradient read back from the files.
    names = [p.name for p in model.trainable_params()]
    pg = g_items["Cell.model.layers.0.mlp.down_proj.Linear.parameters_grad.0"]["weight"][0]
    got = np.load(os.path.join(graph, "dump_tensor_data", pg["data_name"]))
    np.testing.assert_allclose(got, grads_g[names.index("model.layers.0.mlp.down_proj.weight")].asnumpy(), rtol=1e-6)
    run = compare_dirs(graph, eager)
    summary = run.summary()
    assert summary["first_divergence"] is None, summary["first_divergence_reason"]
    assert summary["aligned_items"] >= len(e_items) and not summary["golden_only"]


def test_a_bug_inside_the_graph_is_named_from_the_graph_dump(ms, tmp_path):
    model, _ = _model()
    eager, _, _ = _dump(ms, model, tmp_path / "eager", "pynative", task="statistics")
    _plant_bug(model)
    graph, _, _ = _dump(ms, model, tmp_path / "graph", "graph", task="statistics")
    summary = compare_dirs(graph, eager).summary()
    assert summary["first_divergence"] == f"Cell.{BUGGY}.Linear.forward.0", summary


def test_statistics_are_computed_by_the_dumper_and_probes_stay_quiet_after(ms, tmp_path):
    model, config = _model()
    ids, labels = _data(ms, config)
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "s"), task="statistics", jit="graph")
    step = _step(ms, model)
    dbg.start(model)
    compiled = dbg.jit(step)
    compiled(ids, labels)
    items = _items(dbg.stop())
    out = items["Cell.model.norm.RMSNorm.forward.0"]["output"][0]
    assert out["dtype"] == "Float32" and out["shape"] == [2, 8, config.hidden_size]
    assert {"Max", "Min", "Mean", "Norm"} <= set(out)
    dbg.step()
    compiled(ids, labels)  # the graph keeps its probes; outside a dumped step they record nothing
    assert dbg._dumper.graph is None
    assert not os.path.exists(os.path.join(str(tmp_path / "s"), "step1"))
    dbg.close()


def test_tensordump_files_read_back_in_execution_order(tmp_path):
    """The Ascend route's files ({tag}_{dtype}_{id}.npy, MindSpore's naming): events in id order,
    each probe's n-th file its call n; other files are left alone."""
    from ms_probe.dump_graph import read_tensor_dumps

    tags = {
        "probe0": ("model.fc", "in", 0),
        "probe1": ("model.fc", "out", 0),
        "probe2": ("model.fc", "param", "weight"),
    }
    for name, value in (("probe0_float32_3", 0.0), ("probe1_float32_4", 1.0), ("probe0_float32_12", 2.0),
                        ("probe1_bfloat16_13", 3.0), ("probe2_float32_20", 4.0), ("other_float32_1", 9.0)):  # fmt: skip
        np.save(tmp_path / f"{name}.npy", np.full((2,), value, np.float32))
    events = read_tensor_dumps(tmp_path, tags, settle_s=0.05)
    assert [(e.path, e.kind, e.slot, e.call, float(e.value[0])) for e in events] == [
        ("model.fc", "in", 0, 0, 0.0),
        ("model.fc", "out", 0, 0, 1.0),
        ("model.fc", "in", 0, 1, 2.0),
        ("model.fc", "out", 0, 1, 3.0),
        ("model.fc", "param", "weight", 0, 4.0),
    ]


@pytest.mark.ascend
def test_ascend_tensordump_route_equals_the_pynative_dump(tmp_path):
    """On Ascend, jit="graph" probes are ops.tensordump calls; their dump equals the PyNative one."""
    import mindspore

    mindspore.set_device("Ascend")
    model, _ = _model()
    graph, loss_g, _ = _dump(mindspore, model, tmp_path / "graph", "graph", task="statistics")
    eager, loss_e, _ = _dump(mindspore, model, tmp_path / "eager", "pynative", task="statistics")
    assert loss_g == pytest.approx(loss_e, rel=1e-4)
    assert set(_items(eager)) <= set(_items(graph))
    assert compare_dirs(graph, eager).summary()["first_divergence"] is None
