"""Join rules: MindSpore Transformers' concatenated MLA `linear_qkv` ([q_down; kv_down], one Linear)
against Megatron's `linear_q_down_proj` and `linear_kv_down_proj`, in tensor and statistics mode."""

from __future__ import annotations

import numpy as np
import pytest
from fakenet import NumpyAdapter

from ms_probe import compare_dirs
from ms_probe.config import DumpConfig
from ms_probe.errors import ProbeError
from ms_probe.mapping import load_mapping, mapping_from_dict
from ms_probe.recorder import Recorder

HIDDEN, Q_LORA, KV_LORA = 8, 6, 5
ATTN = "decoder.layers.0.self_attention"


def _weights():
    rng = np.random.default_rng(4)
    return rng.normal(size=(Q_LORA, HIDDEN)).astype(np.float32), rng.normal(size=(KV_LORA, HIDDEN)).astype(np.float32)


def _linear(rec: Recorder, path: str, w: np.ndarray, x: np.ndarray, dout_of) -> np.ndarray:
    """One Linear's forward, backward of sum(sin(out)) and weight gradient, recorded."""
    rec.forward_pre(path, "Linear", (x,), {})
    out = x @ w.T
    rec.forward_post(path, out, [("weight", w)])
    dout = dout_of(out)
    rec.backward(path, "Linear", (dout @ w,), (dout,), None)
    rec.param_grad(path, "Linear", "weight", dout.T @ x, 1)
    return out


def _dump(path, fused: bool, task: str, scale: float = 1.0) -> str:
    wq, wkv = _weights()
    wq = wq * scale
    x = np.random.default_rng(1).normal(size=(4, HIDDEN)).astype(np.float32)
    rec = Recorder(DumpConfig(dump_path=str(path), task=task), NumpyAdapter("Cell" if fused else "Module"), 0)
    rec.step = 0
    rec.start()
    if fused:  # MindFormers, mla_qkv_concat=True
        _linear(rec, f"model.{ATTN}.linear_qkv", np.concatenate([wq, wkv]), x, np.cos)
    else:  # Megatron
        _linear(rec, f"{ATTN}.linear_q_down_proj", wq, x, np.cos)
        _linear(rec, f"{ATTN}.linear_kv_down_proj", wkv, x, np.cos)
    return rec.stop()


def _results(rc) -> dict[str, str]:
    return {m.name: m.result for m in rc.modules}


@pytest.mark.parametrize("task", ["tensor", "statistics"])
def test_the_shipped_deepseek_mapping_joins_megatrons_two_down_projections(tmp_path, task):
    target, golden = _dump(tmp_path / "mf", True, task), _dump(tmp_path / "megatron", False, task)
    rc = compare_dirs(target, golden, load_mapping("mindformers-megatron-deepseek-v3")).ranks[0]
    fused = f"Cell.model.{ATTN}.linear_qkv.Linear"
    expected = {f"{fused}.{kind}.0": "pass" for kind in ("forward", "backward", "parameters_grad")}
    assert _results(rc) == expected, [(m.name, m.result, m.reason) for m in rc.modules]
    assert rc.first_divergence is None and not rc.golden_only, rc.golden_only
    roles = {(r.item.rsplit(".", 2)[-2], r.key) for r in rc.rows if r.result == "pass"}
    assert ("forward", "output.0") in roles and ("forward", "parameters.weight") in roles
    if task == "tensor":  # the gradient w.r.t. the shared input: the sum of the parts'
        assert ("backward", "output.0") in roles
        assert max(r.metrics["MaxAbsErr"] for r in rc.rows if r.metrics) < 1e-5
    else:  # a sum's statistics do not follow from the parts': left one-sided
        assert [r.result for r in rc.rows if r.key == "output.0" and ".backward." in r.item] == ["unmatched"]


def test_a_perturbed_part_is_named_and_without_the_join_nothing_aligns(tmp_path):
    target = _dump(tmp_path / "mf", True, "tensor")
    bad = _dump(tmp_path / "megatron", False, "tensor", scale=1.01)
    rc = compare_dirs(target, bad, load_mapping("mindformers-megatron-deepseek-v3")).ranks[0]
    assert rc.first_divergence == f"Cell.model.{ATTN}.linear_qkv.Linear.forward.0"
    plain = mapping_from_dict({"modules": [{"target": "model.{rest*}", "golden": "{rest*}"}]})
    rc = compare_dirs(target, _dump(tmp_path / "megatron2", False, "tensor"), plain).ranks[0]
    assert set(_results(rc).values()) == {"unmatched"} and len(rc.golden_only) == 6


def test_bad_join_rules_are_named():
    good = {"path": "a.qkv", "side": "golden", "parts": ["a.q", "a.kv"], "axes": {"output": -1}, "sum": []}
    for bad, message in (
        ({"side": "left"}, "side 'left'"),
        ({"parts": ["a.q"]}, "parts"),
        ({"axes": {"weights": 0}}, "role 'weights'"),
        ({"axes": {"output": "last"}}, "'last' is not an int"),
        ({"sum": ["forward.grad"]}, "role 'forward.grad'"),
    ):
        with pytest.raises(ProbeError, match=message):
            mapping_from_dict({"joins": [{**good, **bad}]})
    assert mapping_from_dict({"joins": [good]}).reversed().joins[0].side == "target"
