"""The plan as data: text form, table, msgpack in ms-layout's envelope, atomic files, validation."""

from __future__ import annotations

import pytest

import ms_layout
from ms_recompute import Granularity, LayerPlan, Prediction, RecomputeError, RecomputePlan


def test_text_form_round_trips_and_groups_runs():
    plan = RecomputePlan.parse("0-3=full, 5=mlp+self_attn, 6=mlp", 8, overlap=True)
    assert [lp.label for lp in plan.layers] == ["full"] * 4 + ["none", "mlp+self_attn", "mlp", "none"]
    assert plan.spec == "0-3=full,5=mlp+self_attn,6=mlp"
    assert RecomputePlan.parse(plan.spec, 8, overlap=True) == plan
    assert plan.layers_with("full") == [0, 1, 2, 3]
    assert [g.layers for g in plan.groups] == [(0, 1), (2, 3)]


def test_format_prints_choices_pairs_and_prediction():
    pred = Prediction(baseline_bytes=8 << 20, kept_bytes=2 << 20, working_bytes=1 << 20, recompute_s=0.01)
    text = RecomputePlan.parse("0-2=full", 3, overlap=True, prediction=pred).format()
    assert "0-2=full" in text
    assert "pair  (0, 1): 1c0 1>0 0c0 0>0 1<0 1c1 0<0 0c1" in text
    assert "alone (2): 2c0 2>0 2<0 2c1" in text
    assert "kept  2.00 MiB of 8.00 MiB (saves 6.00 MiB); peak 3.00 MiB" in text


def test_msgpack_round_trip_through_ms_layout_and_files(tmp_path):
    pred = Prediction(100, 40, 10, 0.5, budget_bytes=60, method="exact")
    plan = RecomputePlan.parse("1=full,2=mlp", 3, comms=2, prediction=pred)
    back = RecomputePlan.loads(plan.dumps())
    assert back == plan and back.prediction == pred and back.comms == 2
    assert ms_layout.loads(ms_layout.dumps(plan)) == plan
    path = tmp_path / "plan.msgpack"
    plan.save(path)
    assert RecomputePlan.load(path) == plan
    assert [p.name for p in tmp_path.iterdir()] == ["plan.msgpack"]  # no temporary left behind


def test_a_failed_save_leaves_the_old_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "plan.msgpack"
    old = RecomputePlan.parse("0=full", 2)
    old.save(path)
    new = RecomputePlan.parse("1=full", 2)
    monkeypatch.setattr(RecomputePlan, "dumps", lambda self: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        new.save(path)
    monkeypatch.undo()
    assert RecomputePlan.load(path) == old


@pytest.mark.parametrize(
    "spec, match",
    [
        ("0-3", "layers=what"),
        ("x=full", "'i' or 'i-j'"),
        ("0-9=full", "outside"),
        ("0=full,0=mlp", "twice"),
        ("0=mlp+mlp", "repeat"),
        ("0=mlp+mlp.up_proj", "inside"),
        ("0=mlp-1", "bad sub-module"),
    ],
)
def test_bad_text_is_refused_with_the_reason(spec, match):
    with pytest.raises(RecomputeError, match=match):
        RecomputePlan.parse(spec, 4)


def test_bad_dataclass_input_is_refused():
    with pytest.raises(RecomputeError, match="granularity"):
        LayerPlan(0, "partial")
    with pytest.raises(RecomputeError, match="names no sub-module"):
        LayerPlan(0, Granularity.SELECTIVE)
    with pytest.raises(RecomputeError, match="given with granularity full"):
        LayerPlan(0, Granularity.FULL, ("mlp",))
    with pytest.raises(RecomputeError, match="layer order"):
        RecomputePlan((LayerPlan(1),))
    with pytest.raises(RecomputeError, match="not a recompute plan"):
        RecomputePlan.loads(b"\x93garbage")
    with pytest.raises(RecomputeError, match="schema"):
        RecomputePlan.from_dict({"schema": 99})
