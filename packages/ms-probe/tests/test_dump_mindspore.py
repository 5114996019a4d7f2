"""The MindSpore dumper on small Cells: names, gradients, filters, jit, API level, config file."""

import json
import os

import numpy as np
import pytest

from ms_probe import PrecisionDebugger, ProbeError, compare_dirs

pytestmark = pytest.mark.needs_mindspore


@pytest.fixture(scope="module")
def ms():
    import mindspore

    mindspore.set_device("CPU")
    return mindspore


def _net(ms, jit_inner=False):
    from mindspore import nn, ops

    class Inner(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(4, 4)

        def construct(self, x):
            return ops.relu(self.fc(x))

    if jit_inner:
        Inner.construct = ms.jit(Inner.construct)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.inner = Inner()
            self.out = nn.Dense(4, 2)

        def construct(self, x):
            return self.out(self.inner(x))

    return Net()


def _data(folder):
    return json.load(open(os.path.join(folder, "dump.json")))["data"]


def test_cells_gradients_and_tensors(ms, tmp_path):
    net = _net(ms)
    x = ms.Tensor(np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32))
    dbg = PrecisionDebugger(dump_path=str(tmp_path), task="tensor")
    grad_fn = ms.value_and_grad(lambda v: net(v).sum(), None, net.trainable_params())
    dbg.start(net)
    _, grads = grad_fn(x)
    folder = dbg.stop()
    dbg.step()
    data = _data(folder)
    assert list(data)[:3] == ["Cell.inner.fc.Dense.forward.0", "Cell.inner.Inner.forward.0", "Cell.out.Dense.forward.0"]
    fc = data["Cell.inner.fc.Dense.forward.0"]
    assert fc["input_args"][0]["type"] == "mindspore.Tensor" and fc["input_args"][0]["dtype"] == "Float32"
    assert set(fc["parameters"]) == {"weight", "bias"}
    # The dumped output equals the real one, and the weight gradient equals value_and_grad's.
    h = np.load(os.path.join(folder, "dump_tensor_data", fc["output"][0]["data_name"]))
    np.testing.assert_allclose(h, net.inner.fc(x).asnumpy(), rtol=1e-6)
    pg = data["Cell.out.Dense.parameters_grad.0"]
    assert pg["weight"][0]["shape"] == [2, 4]
    w_grad = np.load(os.path.join(folder, "dump_tensor_data", pg["weight"][0]["data_name"]))
    names = [p.name for p in net.trainable_params()]
    np.testing.assert_allclose(w_grad, grads[names.index("out.weight")].asnumpy(), rtol=1e-6)
    bwd = data["Cell.out.Dense.backward.0"]
    assert bwd["input"][0]["shape"] == [3, 2] and bwd["output"][0]["shape"] == [3, 4]
    # A second step goes to its own folder and restarts the call counters.
    with dbg.dump_step(net):
        net(x)
    assert "Cell.out.Dense.forward.0" in _data(os.path.join(str(tmp_path), "step1", "rank0"))
    dbg.close()


def test_jit_boundary_warns_and_pynative_dumps_inside(ms, tmp_path, caplog):
    net = _net(ms, jit_inner=True)
    x = ms.Tensor(np.ones((2, 4), np.float32))
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "b"), jit="boundary")
    dbg.start(net)
    net(x)
    data = _data(dbg.stop())
    assert dbg.jit_cells == ["inner"] and "mindspore.jit construct" in caplog.text
    assert "Cell.inner.Inner.forward.0" in data and "Cell.inner.fc.Dense.forward.0" not in data
    dbg.close()
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "p"), jit="pynative")
    dbg.start(net)
    net(x)
    assert "Cell.inner.fc.Dense.forward.0" in _data(dbg.stop())
    assert "MS_JIT" not in os.environ
    dbg.close()


def test_whole_step_under_jit_is_dumped_eagerly(ms, tmp_path):
    net = _net(ms)
    x = ms.Tensor(np.ones((2, 4), np.float32))

    def loss(v):  # a def, not a lambda: mindspore.jit cannot parse lambdas
        return net(v).sum()

    step = ms.jit(ms.value_and_grad(loss, None, net.trainable_params()))
    step(x)  # compiled before the debugger: hooks exist only while a step is dumped
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "e"))  # jit="pynative" is the default
    dbg.start(net)
    step(x)
    data = _data(dbg.stop())
    dbg.close()
    assert "Cell.inner.fc.Dense.forward.0" in data and "Cell.inner.fc.Dense.backward.0" in data
    assert "Cell.out.Dense.parameters_grad.0" in data
    step(x)  # and the jit step still compiles and runs after the dumped step


def test_a_step_that_records_nothing_says_why(ms, tmp_path, caplog):
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "j"))
    dbg.start(_net(ms))
    folder = dbg.stop()
    assert _data(folder) == {} and "hooks record nothing" in caplog.text
    assert "jit='pynative'" in open(os.path.join(folder, "dump_error_info.log")).read()


def test_mix_level_dumps_functional_ops_under_their_cell(ms, tmp_path):
    net = _net(ms)
    dbg = PrecisionDebugger(dump_path=str(tmp_path), level="mix")
    dbg.start(net)
    net(ms.Tensor(np.ones((2, 4), np.float32)))
    folder = dbg.stop()
    dbg.close()
    data = _data(folder)
    construct = json.load(open(os.path.join(folder, "construct.json")))
    assert "Functional.relu.0.forward" in data
    assert construct["Functional.relu.0.forward"] == "Cell.inner.Inner.forward.0"
    from mindspore import ops

    assert not hasattr(ops.relu, "__wrapped__")  # restored by close()
    # The same run dumped twice aligns every API call inside its module, and everything passes.
    again = PrecisionDebugger(dump_path=str(tmp_path / "again"), level="mix")
    with again.dump_step(net):
        net(ms.Tensor(np.ones((2, 4), np.float32)))
    rc = compare_dirs(folder, str(tmp_path / "again")).ranks[0]
    apis = [m for m in rc.modules if m.kind == "api"]
    assert apis and all(m.golden and m.result == "pass" for m in apis) and rc.first_divergence is None


def test_config_file_and_errors(ms, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"task": "statistics", "dump_path": str(tmp_path / "d"), "level": "L0", "step": [1],
                               "statistics": {"list": ["out"], "data_mode": ["forward"]}}))  # fmt: skip
    dbg = PrecisionDebugger(config_path=str(cfg))
    net = _net(ms)
    for _ in range(2):
        with dbg.dump_step(net):
            net(ms.Tensor(np.ones((1, 4), np.float32)))
    assert not (tmp_path / "d" / "step0").exists()
    assert list(_data(tmp_path / "d" / "step1" / "rank0")) == ["Cell.out.Dense.forward.0"]
    with pytest.raises(ProbeError, match="needs the model"):
        PrecisionDebugger(dump_path=str(tmp_path)).start()
    with pytest.raises(ProbeError, match="neither"):
        PrecisionDebugger(dump_path=str(tmp_path)).start(object())
    with pytest.raises(ProbeError, match="dump_path"):
        PrecisionDebugger(task="tensor")


def test_synchronous_cpu_reads_tensors_in_place_with_the_same_numbers(ms, tmp_path):
    """With pynative_synchronize the dumper reads each tensor through DLPack (no copy): the
    statistics and the saved tensors equal those of the copying path, bit for bit."""
    from ms_probe.adapter_mindspore import MindSporeAdapter

    net = _net(ms)
    x = ms.Tensor(np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32))
    grad_fn = ms.value_and_grad(lambda v: net(v).sum(), None, net.trainable_params())
    dumps = {}
    for synchronous in (False, True):
        ms.set_context(pynative_synchronize=synchronous)
        try:
            adapter = MindSporeAdapter()
            assert np.array_equal(adapter.to_numpy(x), x.asnumpy()) and adapter._host_view is synchronous
            dbg = PrecisionDebugger(dump_path=str(tmp_path / str(synchronous)), task="tensor")
            with dbg.dump_step(net):
                grad_fn(x)[0].asnumpy()
            dbg.close()
        finally:
            ms.set_context(pynative_synchronize=False)
        dumps[synchronous] = tmp_path / str(synchronous) / "step0" / "rank0"
    copied, viewed = (_data(str(dumps[k])) for k in (False, True))
    assert copied == viewed and len(viewed) > 4
    for f in (dumps[False] / "dump_tensor_data").iterdir():
        assert np.array_equal(np.load(f), np.load(dumps[True] / "dump_tensor_data" / f.name)), f.name


def test_async_statistics_equal_the_synchronous_ones(ms, tmp_path):
    """async_dump: a thread computes the statistics beside the step, on in-place views of the
    tensors; the dump equals the one computed in the hooks."""
    net = _net(ms)
    x = ms.Tensor(np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32))
    grad_fn = ms.value_and_grad(lambda v: net(v).sum(), None, net.trainable_params())
    ms.set_context(pynative_synchronize=True)
    try:
        for mode in (False, True):
            dbg = PrecisionDebugger(dump_path=str(tmp_path / str(mode)), task="statistics", async_dump=mode)
            for _ in range(2):  # the worker thread carries over to the next step
                with dbg.dump_step(net):
                    grad_fn(x)[0].asnumpy()
            dbg.close()
    finally:
        ms.set_context(pynative_synchronize=False)
    for step in ("step0", "step1"):
        sync, async_ = (_data(str(tmp_path / m / step / "rank0")) for m in ("False", "True"))
        assert sync == async_ and len(sync) > 4
        assert all(rec["Max"] is not None for item in async_.values() for rec in item.get("output", []) if rec)
    with pytest.raises(ProbeError, match="async_dump='yes'"):
        PrecisionDebugger(dump_path=str(tmp_path), async_dump="yes")
