"""Statistics: equal to a plain numpy reference, and computed once per distinct tensor of a step
(stats_cache.py) with the same numbers under every name the tensor is dumped as."""

import json
import math
import os

import numpy as np
import pytest
from fakenet import NumpyAdapter

from ms_probe import PrecisionDebugger
from ms_probe.config import DumpConfig
from ms_probe.recorder import Recorder
from ms_probe.stats import array_stats
from ms_probe.stats_cache import StatsCache


def _reference(a: np.ndarray) -> dict:
    """The statistics the plain way: numpy's own reductions of the flattened array."""
    flat = np.ascontiguousarray(a).reshape(-1)
    wide = flat.astype(np.float64)
    return {
        "Max": float(flat.max()),
        "Min": float(flat.min()),
        "Mean": float(wide.sum()) / flat.size,
        "Norm": math.sqrt(float(np.dot(wide, wide))),
        "NanCount": int(np.isnan(flat).sum()),
        "InfCount": int(np.isinf(flat).sum()),
    }


def _same(got, want, rel=0.0) -> bool:
    if isinstance(got, str):  # "nan", "inf", "-inf"
        return math.isnan(want) if got == "nan" else float(got) == want
    return got == pytest.approx(want, rel=rel, abs=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_stats_equal_a_plain_numpy_reference(dtype):
    rng = np.random.default_rng(1)
    arrays = [
        rng.normal(size=(64, 33)).astype(dtype),
        rng.normal(size=(8, 16, 4)).astype(dtype).transpose(2, 0, 1),  # not contiguous
        rng.normal(size=(40, 40)).astype(dtype)[::2, 1::3],  # strided
        np.full((5,), 3.0, dtype),
    ]
    nonfinite = rng.normal(size=(7, 9)).astype(dtype)
    nonfinite[1, 2], nonfinite[3, 3], nonfinite[6, 0] = np.nan, np.inf, -np.inf
    only_inf = rng.normal(size=(4, 4)).astype(dtype)
    only_inf[0, 0] = np.inf
    for a in [*arrays, nonfinite, only_inf]:
        got, want = array_stats(a), _reference(a.astype(np.float32) if dtype == np.float16 else a)
        assert (got["NanCount"], got["InfCount"]) == (want["NanCount"], want["InfCount"])
        assert _same(got["Max"], want["Max"]) and _same(got["Min"], want["Min"])
        # float32 (and float16 data) is summed in float32, in memory order: its error is bounded
        # against the sum of magnitudes, not the mean (a mean near 0 has a large relative error)
        if math.isfinite(want["Mean"]):
            scale = float(np.abs(a.astype(np.float64)).mean())
            assert abs(got["Mean"] - want["Mean"]) <= 1e-6 * scale
        else:
            assert _same(got["Mean"], want["Mean"])
        assert _same(got["Norm"], want["Norm"], rel=1e-6)  # float32: BLAS dot against a float64 one
        json.dumps(got, allow_nan=False)
    s = array_stats(nonfinite)
    assert s["Max"] == "nan" and s["Mean"] == "nan" and s["Norm"] == "nan" and (s["NanCount"], s["InfCount"]) == (1, 2)
    s = array_stats(only_inf)
    assert s["Max"] == "inf" and s["Mean"] == "inf" and s["NanCount"] == 0 and s["InfCount"] == 1
    if dtype == np.float32:  # float32 data: exactly numpy's float32 reductions over memory order
        for a in arrays:
            got, flat = array_stats(a), a.ravel(order="K")
            assert got["Mean"] == float(flat.sum()) / flat.size and got["Max"] == float(flat.max())
            assert got["Norm"] == math.sqrt(float(np.dot(flat, flat)))


class KeyedAdapter(NumpyAdapter):
    """The numpy adapter with a storage key (the MindSpore and torch adapters have one)."""

    def storage_key(self, x):
        return (x.__array_interface__["data"][0], x.shape, x.strides, x.dtype.str)


def _run(rec: Recorder, x: np.ndarray, w: np.ndarray) -> None:
    """fc -> act -> (act's output is the next module's input, and the parent's output)."""

    def call(path, cls, fn, arg, params=()):
        rec.forward_pre(path, cls, (arg,), {})
        out = fn(arg)
        rec.forward_post(path, out, list(params))
        return out

    def block(h):
        h = call("block.fc", "Dense", lambda a: a @ w, h, [("weight", w)])
        return call("block.act", "ReLU", lambda a: np.maximum(a, 0), h)

    rec.start()
    call("block", "Block", block, x)
    rec.stop()


@pytest.mark.parametrize("async_dump", [False, True])
def test_a_tensor_seen_twice_has_the_same_stats_under_both_names(tmp_path, async_dump):
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(6, 8)).astype(np.float32), rng.normal(size=(8, 8)).astype(np.float32)
    x[0, 0] = np.nan  # a non-finite tensor is cached like any other
    dumps = {}
    for adapter in (NumpyAdapter(), KeyedAdapter()):
        folder = tmp_path / type(adapter).__name__
        rec = Recorder(DumpConfig(dump_path=str(folder), async_dump=async_dump), adapter, 0)
        _run(rec, x, w)
        dumps[type(adapter).__name__] = json.loads((folder / "step0" / "rank0" / "dump.json").read_text())["data"]
        if isinstance(adapter, KeyedAdapter):
            # block's input is fc's; fc's output act's input; act's output block's
            assert rec.stats_cache.hits == 0  # emptied at stop()
    plain, cached = dumps["NumpyAdapter"], dumps["KeyedAdapter"]
    assert plain == cached  # the cache changes no number
    fc, act, block = (cached[f"Cell.{p}.forward.0"] for p in ("block.fc.Dense", "block.act.ReLU", "block.Block"))
    assert fc["output"][0] == act["input_args"][0] and act["output"][0] == block["output"][0]
    assert block["input_args"][0] == fc["input_args"][0] and fc["input_args"][0]["NanCount"] == 1
    assert act["input_args"][0]["Max"] == "nan" and act["input_args"][0]["NanCount"] == 8  # x's NaN row


def test_the_cache_counts_repeats_and_keeps_a_bounded_number_of_tensors(tmp_path):
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(6, 8)).astype(np.float32), rng.normal(size=(8, 8)).astype(np.float32)
    rec = Recorder(DumpConfig(dump_path=str(tmp_path)), KeyedAdapter(), 0)
    hits = []
    stop = rec.stop

    def counting_stop():
        hits.append(rec.stats_cache.hits)
        return stop()

    rec.stop = counting_stop
    _run(rec, x, w)
    assert hits == [3]  # fc's input (block's), act's input (fc's output), block's output (act's)
    cache = StatsCache(size=2)
    for i in range(3):
        cache.put(i, {"Max": i}, None)
    assert cache.get(0) is None and cache.get(2) == {"Max": 2} and cache.hits == 1


def _ms_net(ms):
    from mindspore import nn

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Dense(4, 8), nn.ReLU(), nn.Dense(8, 2)

        def construct(self, x):
            return self.fc2(self.act(self.fc1(x)))

    return Net()


@pytest.mark.needs_mindspore
@pytest.mark.parametrize("async_dump", [False, True])
def test_mindspore_dump_is_the_same_with_and_without_the_cache(tmp_path, monkeypatch, async_dump):
    import mindspore as ms

    from ms_probe.adapter_mindspore import MindSporeAdapter

    ms.set_device("CPU")
    net = _ms_net(ms)
    x = ms.Tensor(np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32))
    grad_fn = ms.value_and_grad(lambda v: net(v).sum(), None, net.trainable_params())
    ms.set_context(pynative_synchronize=True)
    dumps = {}
    try:
        for cached in (True, False):
            if not cached:
                monkeypatch.setattr(MindSporeAdapter, "storage_key", lambda self, x: None)
            dbg = PrecisionDebugger(dump_path=str(tmp_path / str(cached)), task="statistics", async_dump=async_dump)
            with dbg.dump_step(net):
                grad_fn(x)[0].asnumpy()
            dbg.close()
            folder = tmp_path / str(cached) / "step0" / "rank0"
            dumps[cached] = json.loads(open(os.path.join(folder, "dump.json")).read())["data"]
    finally:
        ms.set_context(pynative_synchronize=False)
    assert dumps[True] == dumps[False] and len(dumps[True]) > 4
    data = dumps[True]
    fc1, act = data["Cell.fc1.Dense.forward.0"], data["Cell.act.ReLU.forward.0"]
    assert fc1["output"][0] == act["input_args"][0] and fc1["output"][0]["Max"] is not None


@pytest.mark.needs_torch
def test_torch_tensor_updated_in_place_gets_new_stats(tmp_path):
    """ReLU(inplace=True) updates Linear's output: its version counter changes, so the ReLU's
    output is not taken for its input (the same memory). Forward only: torch refuses in-place
    updates of the outputs of its backward hooks."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(inplace=True), torch.nn.Linear(8, 2))
    dbg = PrecisionDebugger(dump_path=str(tmp_path), task="statistics")
    with dbg.dump_step(net), torch.no_grad():
        net(torch.randn(3, 4))
    dbg.close()
    data = json.loads((tmp_path / "step0" / "rank0" / "dump.json").read_text())["data"]
    lin, relu = data["Module.0.Linear.forward.0"], data["Module.1.ReLU.forward.0"]
    assert lin["output"][0] == relu["input_args"][0] and lin["output"][0]["Min"] < 0
    assert relu["output"][0]["Min"] == 0.0
    assert relu["output"][0] == data["Module.2.Linear.forward.0"]["input_args"][0]
