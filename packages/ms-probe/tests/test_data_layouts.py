"""Data-layout rules: MindSpore Transformers' interleaved linear_fc1 against Megatron's stacked one."""

from __future__ import annotations

import numpy as np
import pytest
from fakenet import GatedMLP, NumpyAdapter

from ms_probe.compare import compare_dirs
from ms_probe.config import DumpConfig
from ms_probe.errors import ProbeError
from ms_probe.mapping import load_mapping, mapping_from_dict
from ms_probe.recorder import Recorder

MF = "model.decoder.layers.0.mlp"  # MindSpore Transformers' Cell path
MEGATRON = "decoder.layers.0.mlp"


def _dump(path, net: GatedMLP, prefix: str) -> str:
    rec = Recorder(DumpConfig(dump_path=str(path), task="tensor"), NumpyAdapter(prefix), 0)
    rec.step = 0
    rec.start()
    net.run(rec, np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32))
    return rec.stop()


def _dumps(tmp_path):
    target = _dump(tmp_path / "mf", GatedMLP(interleaved=True, prefix=MF), "Cell")
    golden = _dump(tmp_path / "megatron", GatedMLP(interleaved=False, prefix=MEGATRON), "Module")
    return target, golden


def _results(rc) -> dict[str, str]:
    return {m.name: m.result for m in rc.modules}


def test_interleaved_fc1_compares_clean_with_the_rule(tmp_path):
    target, golden = _dumps(tmp_path)
    rc = compare_dirs(target, golden, load_mapping("mindformers-megatron-llama")).ranks[0]
    assert rc.mode == "tensor" and rc.first_divergence is None, rc.first_divergence_reason
    assert set(_results(rc).values()) == {"pass"}, _results(rc)
    fc1 = [r for r in rc.rows if "linear_fc1" in r.item]
    assert {r.role for r in fc1} >= {"output", "input", "parameter", "param_grad"}
    # the same numbers in another order: equal up to the summation order of the matmuls
    assert max(r.metrics["MaxAbsErr"] for r in fc1) < 1e-5, [(r.key, r.metrics["MaxAbsErr"]) for r in fc1]


def test_interleaved_fc1_diverges_without_the_rule(tmp_path):
    target, golden = _dumps(tmp_path)
    plain = mapping_from_dict({"modules": [{"target": "model.{rest*}", "golden": "{rest*}"}]})
    rc = compare_dirs(target, golden, plain).ranks[0]
    assert rc.first_divergence == f"Cell.{MF}.linear_fc1.Linear.forward.0"
    bad = {r.role for r in rc.rows if "linear_fc1" in r.item and r.result == "error"}
    assert bad >= {"output", "parameter"}, bad
    # linear_fc2 sees the same numbers either way: its inputs are the activations, not fc1's layout
    assert _results(rc)[f"Cell.{MF}.linear_fc2.Linear.forward.0"] == "pass"


def test_reversed_mapping_rearranges_the_golden_side(tmp_path):
    target, golden = _dumps(tmp_path)
    rc = compare_dirs(golden, target, load_mapping("mindformers-megatron-llama", reverse=True)).ranks[0]
    assert rc.first_divergence is None and set(_results(rc).values()) == {"pass"}


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({"rule": "shuffle"}, "rule 'shuffle'"),
        ({"parts": 1}, "parts 1"),
        ({"side": "left"}, "side 'left'"),
        ({"axes": {"weights": 0}}, "axes key 'weights'"),
        ({"axes": {"output": "last"}}, "'last' is not an int"),
    ],
)
def test_bad_layout_rules_are_named(rule, message):
    good = {"path": "{p*}.linear_fc1", "side": "target", "rule": "deinterleave", "parts": 2, "axes": {"output": -1}}
    with pytest.raises(ProbeError, match=message):
        mapping_from_dict({"layouts": [{**good, **rule}]})


def test_rule_that_does_not_fit_the_tensor_is_named():
    m = mapping_from_dict(
        {"layouts": [{"path": "fc1", "side": "target", "rule": "deinterleave", "parts": 2, "axes": {"output": -1}}]}
    )
    with pytest.raises(ProbeError, match="size 3 does not split into 2"):
        m.in_compare_layout("target", "fc1", "forward", "output", np.zeros((2, 3)))
    x = np.arange(12.0).reshape(2, 6)
    assert m.in_compare_layout("target", "fc1", "forward", "input", x) is x  # role not listed: untouched
    assert m.to_dict()["layouts"][0]["rule"] == "deinterleave"


# ---------------------------------------------------------------------------------------------
# A fused QKV projection: MindSpore Transformers' SelfAttentionContiguous stacks [Q; K; V], Megatron
# (and MindFormers' default SelfAttention) groups the rows per query group [q0, k0, v0, q1, ...]

GROUPS, HEADS_PER_GROUP, HEAD_DIM, HIDDEN = 2, 3, 4, 8
QKV_PARTS = [HEADS_PER_GROUP, 1, 1]


def _qkv_weights(contiguous: bool) -> np.ndarray:
    rng = np.random.default_rng(3)
    q = rng.normal(size=(GROUPS, HEADS_PER_GROUP * HEAD_DIM, HIDDEN)).astype(np.float32)
    k, v = (rng.normal(size=(GROUPS, HEAD_DIM, HIDDEN)).astype(np.float32) for _ in range(2))
    if contiguous:
        return np.concatenate([q.reshape(-1, HIDDEN), k.reshape(-1, HIDDEN), v.reshape(-1, HIDDEN)])
    return np.concatenate([q, k, v], axis=1).reshape(-1, HIDDEN)


def _qkv_dump(path, contiguous: bool, prefix: str) -> str:
    w = _qkv_weights(contiguous)
    x = np.random.default_rng(1).normal(size=(4, HIDDEN)).astype(np.float32)
    rec = Recorder(DumpConfig(dump_path=str(path), task="tensor"), NumpyAdapter(prefix), 0)
    rec.step = 0
    rec.start()
    name = f"{'model.' if contiguous else ''}decoder.layers.0.self_attention.linear_qkv"
    rec.forward_pre(name, "Linear", (x,), {})
    out = x @ w.T
    rec.forward_post(name, out, [("weight", w)])
    dout = np.cos(out)  # the gradient of sum(sin(out)): elementwise, so it follows the layout
    rec.backward(name, "Linear", (dout @ w,), (dout,), None)
    rec.param_grad(name, "Linear", "weight", dout.T @ x, 1)
    return rec.stop()


def _qkv_mapping(with_rule: bool):
    axes = {"forward.output": -1, "backward.input": -1, "parameter": 0, "param_grad": 0}
    rule = {"path": "model.{p*}.linear_qkv", "side": "target", "rule": "group", "groups": GROUPS, "parts": QKV_PARTS}
    modules = [{"target": "model.{rest*}", "golden": "{rest*}"}]
    return mapping_from_dict({"modules": modules, "layouts": [{**rule, "axes": axes}] * with_rule})


def test_contiguous_qkv_compares_clean_with_the_group_rule_and_diverges_without(tmp_path):
    target = _qkv_dump(tmp_path / "mf", contiguous=True, prefix="Cell")
    golden = _qkv_dump(tmp_path / "megatron", contiguous=False, prefix="Module")
    clean = compare_dirs(target, golden, _qkv_mapping(True)).ranks[0]
    assert clean.first_divergence is None and set(_results(clean).values()) == {"pass"}, _results(clean)
    assert max(r.metrics["MaxAbsErr"] for r in clean.rows) < 1e-5
    plain = compare_dirs(target, golden, _qkv_mapping(False)).ranks[0]
    assert plain.first_divergence == "Cell.model.decoder.layers.0.self_attention.linear_qkv.Linear.forward.0"


def test_group_and_ungroup_are_inverse_and_misfits_are_named():
    m = _qkv_mapping(True)
    (rule,) = m.layouts
    stacked, grouped = _qkv_weights(True), _qkv_weights(False)
    assert np.array_equal(rule.apply(stacked, 0), grouped)
    back = mapping_from_dict({"layouts": [{**rule.to_dict(), "rule": "ungroup"}]}).layouts[0]
    assert np.array_equal(back.apply(grouped, 0), stacked)
    with pytest.raises(ProbeError, match=r"size 12 is not 2 groups of parts \[3, 1, 1\]"):
        rule.apply(np.zeros((12, 2)), 0)
    for bad, message in (({"groups": 0}, "groups 0"), ({"parts": [3]}, r"parts \[3\]"), ({"parts": 2}, "parts 2")):
        with pytest.raises(ProbeError, match=message):
            mapping_from_dict({"layouts": [{**rule.to_dict(), **bad}]})
