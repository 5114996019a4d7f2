"""Statistics, config, names, metrics and mappings: numpy only, no framework."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_probe import DumpConfig, ProbeError, config_from_dict, load_config, load_mapping, mapping_from_dict
from ms_probe.mapping import Template, shipped_mappings
from ms_probe.metrics import stat_metrics, tensor_metrics
from ms_probe.naming import api_item, module_item, param_grad_item, parse_item
from ms_probe.rules import Thresholds, module_verdict
from ms_probe.stats import array_stats, json_float, tensor_info


def test_stats_match_numpy_and_count_nonfinite():
    a = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
    s = array_stats(a)
    assert s["Max"] == pytest.approx(float(a.max())) and s["Min"] == pytest.approx(float(a.min()))
    # float32 data summed in float32 (numpy's pairwise sum): within a few ulp of the float64 mean
    assert s["Mean"] == pytest.approx(float(a.astype(np.float64).mean()), rel=1e-6)
    assert s["Norm"] == pytest.approx(float(np.sqrt((a.astype(np.float64) ** 2).sum())), rel=1e-6)
    assert s["NanCount"] == 0 and s["InfCount"] == 0
    a[0, 0], a[1, 1], a[2, 2] = np.nan, np.inf, -np.inf
    s = array_stats(a)
    assert (s["NanCount"], s["InfCount"]) == (1, 2)
    assert s["Max"] == "nan"  # strict JSON: non-finite values are strings
    json.dumps(s, allow_nan=False)
    assert math.isnan(json_float("nan")) and json_float("-inf") == -math.inf and json_float(2) == 2.0


def test_stats_of_special_dtypes():
    assert array_stats(np.zeros((0, 3), np.float32))["Max"] is None
    b = array_stats(np.array([True, False, True]))
    assert b["Max"] is True and b["Min"] is False and b["Mean"] == pytest.approx(2 / 3)
    i = array_stats(np.array([1, 2, 3], np.int64))
    assert i["Mean"] == 2.0 and i["Norm"] == pytest.approx(math.sqrt(14))
    # A float32 mask of -3.4e38 overflows a float32 norm; it is recomputed in float64.
    m = array_stats(np.full((4, 4), np.finfo(np.float32).min, np.float32))
    assert math.isfinite(m["Norm"]) and m["InfCount"] == 0
    assert m["Mean"] == pytest.approx(float(np.finfo(np.float32).min))  # its float32 sum overflows too
    info = tensor_info(np.ones(3, np.float16), type_name="t", dtype_name="Float16", summary_mode="md5")
    assert info["shape"] == [3] and len(info["md5"]) == 8


def test_config_ranges_and_errors(tmp_path):
    cfg = DumpConfig(dump_path=str(tmp_path), step=[0, "3-5"], rank="2")
    assert cfg.step == [0, 3, 4, 5] and cfg.rank == [2]
    for bad in (dict(task="overflow_check"), dict(level="L2"), dict(step=["5-3"]), dict(scope=["a"]), dict(rank=[-1])):
        with pytest.raises(ProbeError):
            DumpConfig(dump_path=str(tmp_path), **bad)
    with pytest.raises(ProbeError, match="dump_path"):
        DumpConfig(dump_path="")
    assert DumpConfig(dump_path="d", data_mode=["forward"]).wants("forward", "input")
    assert not DumpConfig(dump_path="d", data_mode=["forward"]).wants("backward", "input")
    assert not DumpConfig(dump_path="d", data_mode=["input"]).wants("forward", "output")


def test_msprobe_config_json(tmp_path):
    # msprobe's shipped default config.json, with our dump level.
    raw = {
        "task": "tensor",
        "dump_path": str(tmp_path / "d"),
        "rank": [],
        "step": ["1-2"],
        "level": "L0",
        "extra_info": True,
        "async_dump": False,
        "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"},
        "tensor": {"scope": [], "list": ["mlp"], "data_mode": ["forward"]},
        "acc_check": {"white_list": [], "black_list": [], "error_data_path": "./"},
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    cfg = load_config(path)
    assert (cfg.task, cfg.step, cfg.list, cfg.data_mode) == ("tensor", [1, 2], ["mlp"], ["forward"])
    assert load_config(path, task="statistics").task == "statistics"
    with pytest.raises(ProbeError, match="unknown config keys"):
        config_from_dict({**raw, "bogus": 1})
    path.write_text("{not json")
    with pytest.raises(ProbeError, match="not valid JSON"):
        load_config(path)


_seg = st.from_regex(r"[a-z_][a-z0-9_]{0,6}|[0-9]{1,2}", fullmatch=True)


@given(st.lists(_seg, min_size=1, max_size=5), st.sampled_from(["Linear", "RMSNorm"]), st.integers(0, 9))
@settings(max_examples=60, deadline=None)
def test_names_round_trip(segments, cls, index):
    path = ".".join(segments)
    for direction in ("forward", "backward"):
        p = parse_item(module_item("Cell", path, cls, direction, index))
        assert (p.kind, p.path, p.cls, p.direction, p.index) == ("module", path, cls, direction, index)
    p = parse_item(param_grad_item("Module", path, cls, index))
    assert (p.kind, p.path, p.cls, p.index) == ("param_grad", path, cls, index)
    p = parse_item(api_item("Functional", path, index))
    assert (p.kind, p.prefix, p.path, p.index) == ("api", "Functional", path, index)
    assert parse_item("not-a-name") is None


def test_tensor_metrics_against_definitions():
    rng = np.random.default_rng(0)
    b = rng.normal(size=1000)
    n = b * 1.0002
    m = tensor_metrics(n, b)
    assert m["Cosine"] == pytest.approx(1.0, abs=1e-12)
    assert m["MaxRelativeErr"] == pytest.approx(2e-4, rel=1e-6)
    assert m["One Thousandth Err Ratio"] == 1.0
    assert m["RMSE"] == pytest.approx(np.sqrt(np.mean((n - b) ** 2)))
    assert m["RelL2"] == pytest.approx(2e-4, rel=1e-6)
    m = tensor_metrics(b * 1.5, b)
    assert m["One Thousandth Err Ratio"] == 0.0 and m["Cosine"] == pytest.approx(1.0)
    assert tensor_metrics(-b, b)["Cosine"] == pytest.approx(-1.0)
    x = b.copy()
    x[3] = np.nan
    assert tensor_metrics(x, b)["NonfiniteMismatch"] == 1
    assert tensor_metrics(x, x)["NonfiniteMismatch"] == 0


def test_stat_metrics_deviation_sees_a_transpose_that_keeps_the_norm():
    same = {"Max": 2.0, "Min": -1.0, "Mean": 0.1, "Norm": 10.0}
    assert stat_metrics(same, same)["Deviation"] == 0.0
    moved = {"Max": 1.5, "Min": -1.0, "Mean": 0.1, "Norm": 10.0}
    d = stat_metrics(moved, same)
    assert d["Deviation"] == pytest.approx(0.25) and d["NormRelativeErr"] == 0.0
    assert stat_metrics({**same, "NanCount": 1}, {**same, "NanCount": 0})["NonfiniteMismatch"] == 1


def test_module_rules_blame_outputs_not_inherited_errors():
    th = Thresholds()
    good = {"Deviation": 1e-7, "_shape_ok": True}
    bad = {"Deviation": 0.3, "_shape_ok": True}
    assert module_verdict("statistics", [good], [bad], [], th)[0] == "warning"
    assert module_verdict("statistics", [good], [{"Deviation": 0.9}], [], th)[0] == "error"
    assert module_verdict("statistics", [bad], [bad], [], th)[0] == "pass"  # inherited
    assert module_verdict("statistics", [good], [{"Deviation": 5e-6}], [], th)[0] == "pass"  # rounding noise
    assert module_verdict("statistics", [good], [good], [("weight", "error", "x")], th)[0] == "error"
    t_in = {"One Thousandth Err Ratio": 0.999, "Cosine": 1.0, "RelL2": 1e-7}
    t_out = {"One Thousandth Err Ratio": 0.1, "Cosine": 1.0, "RelL2": 0.5}
    assert module_verdict("tensor", [t_in], [t_out], [], th)[0] == "error"


def test_shapes_that_hold_the_same_data():
    from ms_probe.pairing import shapes_compatible

    assert shapes_compatible((2, 8, 128), (2, 1, 8, 128)) is None  # HF's head axis
    assert shapes_compatible((16, 64), (2, 8, 64)) is None  # tokens flattened
    assert shapes_compatible((4, 4), (2, 8)) == "shape [4, 4] vs [2, 8]"
    assert shapes_compatible((2, 3), (3, 2)) is not None


def test_templates_map_both_ways():
    t, g = Template("model.decoder.layers.{i}.self_attention.linear_qb"), Template("decoder.layers.{i}.x.{rest*}")
    assert t.match("model.decoder.layers.12.self_attention.linear_qb") == {"i": "12"}
    assert t.match("model.decoder.layers.1.2.self_attention.linear_qb") is None
    assert g.fill({"i": "3", "rest": "a.b"}) == "decoder.layers.3.x.a.b"
    assert g.fill({"i": "3", "rest": ""}) == "decoder.layers.3.x"


def test_shipped_mappings_load_and_reverse():
    names = shipped_mappings()
    assert {"ms-models-hf", "mindformers-megatron-llama", "mindformers-megatron-deepseek-v3"} <= set(names)
    ds = load_mapping("mindformers-megatron-deepseek-v3")
    assert (
        ds.map_path("model.decoder.layers.1.self_attention.linear_qb")
        == "decoder.layers.1.self_attention.linear_q_up_proj"
    )
    assert ds.map_path("model.embedding.word_embeddings") == "embedding.word_embeddings"
    assert ds.golden_key("module.module.decoder.final_layernorm") == "decoder.final_layernorm"
    assert "FFNGroupedGEMM" in ds.skip_reason(
        "golden", "module.decoder.layers.1.mlp.experts.local_experts.3.linear_fc1"
    )
    back = load_mapping("mindformers-megatron-deepseek-v3", reverse=True)
    assert back.map_path("module.decoder.layers.4.self_attention.linear_kv_up_proj") == (
        "model.decoder.layers.4.self_attention.linear_kvb"
    )
    llama = load_mapping("mindformers-megatron-llama")
    assert (
        llama.map_path("model.decoder.layers.0.self_attention.linear_qkv")
        == "decoder.layers.0.self_attention.linear_qkv"
    )
    assert llama.skip_reason("target", "model.decoder.layers.0.mlp.activation_func")


def test_bad_mappings_are_refused(tmp_path):
    with pytest.raises(ProbeError, match="placeholders differ"):
        mapping_from_dict({"modules": [{"target": "a.{i}", "golden": "b"}]})
    with pytest.raises(ProbeError, match="missing key 'golden'"):
        mapping_from_dict({"modules": [{"target": "a"}]})
    with pytest.raises(ProbeError, match="side"):
        mapping_from_dict({"skip": [{"side": "left", "path": "a"}]})
    bad = tmp_path / "m.yaml"
    bad.write_text("modules: [unclosed")
    with pytest.raises(ProbeError, match="not valid YAML"):
        load_mapping(bad)
    with pytest.raises(ProbeError, match="neither a file nor a shipped mapping"):
        load_mapping("no-such-mapping")
