"""Whole-model plans on a tiny Llama: split training weights to fused inference weights and back."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_llama import HEAD_DIM, KV_HEADS, expected_shard, llama_shapes, random_weights

from ms_layout import ParallelConfig
from ms_reshard import (
    DEFAULT_FUSIONS,
    FusionRule,
    ParamSpec,
    ReshardError,
    apply_model_local,
    model_plan,
    param_specs,
    rules_from_data,
    validate,
)


def _source_shards(specs, weights, fusions):
    """Each source rank's shard; a fused source parameter holds its parts' shards side by side."""
    return {
        name: {r: expected_shard(name, spec, weights, fusions, r) for r in spec.layout.ranks}
        for name, spec in specs.items()
    }


def _check(src_specs, dst_specs, weights, fusions=DEFAULT_FUSIONS, **kw):
    mp = model_plan(src_specs, dst_specs, fusions=fusions, **kw)
    out = apply_model_local(mp, _source_shards(src_specs, weights, fusions))
    assert set(out) == set(dst_specs)
    for name, spec in dst_specs.items():
        for rank in spec.layout.ranks:
            np.testing.assert_array_equal(out[name][rank], expected_shard(name, spec, weights, fusions, rank))
    for move in mp.moves:
        validate(move.plan)
    return mp


def test_dp2_tp2_optimizer_sharded_split_to_tp4_fused():
    shapes = llama_shapes()
    weights = random_weights(shapes)
    train = param_specs(shapes, ParallelConfig(dp=2, tp=2, optimizer_shard=True), num_layers=2)
    infer = param_specs(shapes, ParallelConfig(tp=4), num_layers=2, fusions=DEFAULT_FUSIONS)
    assert "model.layers.0.self_attn.qkv_proj.weight" in infer and "model.layers.0.mlp.gate_up_proj.weight" in infer
    assert train["model.layers.0.self_attn.q_proj.weight"].layout.dims[0] == ("tp", "dp")  # optimizer shard
    mp = _check(train, infer, weights)
    # layers share plans: the distinct plans do not grow with depth
    assert (
        mp.unique_plans()
        == model_plan(
            param_specs(llama_shapes(1), ParallelConfig(dp=2, tp=2, optimizer_shard=True), num_layers=1),
            param_specs(llama_shapes(1), ParallelConfig(tp=4), num_layers=1, fusions=DEFAULT_FUSIONS),
        ).unique_plans()
    )
    assert mp.bytes_moved() == mp.lower_bound_total()


def test_fused_training_weights_to_split_inference_weights():
    shapes = llama_shapes()
    weights = random_weights(shapes, seed=1)
    train = param_specs(shapes, ParallelConfig(tp=2, dp=2), num_layers=2, fusions=DEFAULT_FUSIONS)
    infer = param_specs(shapes, ParallelConfig(tp=4), num_layers=2)
    _check(train, infer, weights)


def test_pp2_tp2_to_tp2_on_two_of_the_ranks():
    shapes = llama_shapes()
    weights = random_weights(shapes, seed=2)
    train = param_specs(shapes, ParallelConfig(tp=2, pp=2), num_layers=2)
    infer = param_specs(shapes, ParallelConfig(tp=2), num_layers=2, fusions=DEFAULT_FUSIONS)
    assert train["model.layers.1.mlp.up_proj.weight"].layout.ranks == (2, 3)
    mp = _check(train, infer, weights)
    per_rank = mp.per_rank()
    assert per_rank[2]["received"] == per_rank[3]["received"] == 0  # stage 1 only sends
    assert per_rank[2]["sent"] > 0
    # the totals add each shared plan once per move, like a plain sum over the moves
    want: dict[int, dict[str, int]] = {}
    for m in mp.moves:
        for row in m.plan.per_rank():
            acc = want.setdefault(row["rank"], {"sent": 0, "received": 0, "lower_bound": 0})
            for k in acc:
                acc[k] += row[k]
    assert per_rank == dict(sorted(want.items())) and list(per_rank) == sorted(want)
    assert mp.bytes_moved() == sum(m.plan.bytes_moved() for m in mp.moves) == sum(r["received"] for r in want.values())
    assert mp.lower_bound_total() == sum(r["lower_bound"] for r in want.values())


def test_fused_to_fused_with_another_tp_goes_part_by_part():
    shapes = llama_shapes()
    weights = random_weights(shapes, seed=4)
    train = param_specs(shapes, ParallelConfig(tp=4), num_layers=2, fusions=DEFAULT_FUSIONS)
    infer = param_specs(shapes, ParallelConfig(tp=2, dp=2), num_layers=2, fusions=DEFAULT_FUSIONS)
    assert train["model.layers.0.self_attn.qkv_proj.weight"].parts == (16, 8, 8)
    mp = _check(train, infer, weights)
    assert sum(m.dst_name.endswith("qkv_proj.weight") for m in mp.moves) == 2 * 3


def test_a_fusion_rule_is_data():
    rules = rules_from_data([{"fused": "kv_proj", "parts": ["k_proj", "v_proj"], "dim": 0}])
    shapes = llama_shapes(1)
    weights = random_weights(shapes, seed=3)
    train = param_specs(shapes, ParallelConfig(tp=2), num_layers=1)
    spec_k = train["model.layers.0.self_attn.k_proj.weight"]
    dst = {n: s for n, s in train.items() if "k_proj" not in n and "v_proj" not in n}
    dst["model.layers.0.self_attn.kv_proj.weight"] = ParamSpec(spec_k.layout, (2 * KV_HEADS * HEAD_DIM, 16))
    _check(train, dst, weights, fusions=rules)


def test_missing_source_and_bad_shapes_are_named():
    shapes = llama_shapes(1)
    train = param_specs(shapes, ParallelConfig(tp=2), num_layers=1)
    infer = param_specs(shapes, ParallelConfig(tp=2), num_layers=1)
    src = dict(train)
    del src["model.norm.weight"]
    with pytest.raises(ReshardError, match=r"no source for target parameter 'model.norm.weight'"):
        model_plan(src, infer)
    extra = dict(train, **{"model.extra.weight": train["model.norm.weight"]})
    with pytest.raises(ReshardError, match="have no target"):
        model_plan(extra, infer)
    assert model_plan(extra, infer, allow_unused=True).unused == ("model.extra.weight",)
    bad = dict(infer)
    bad["model.norm.weight"] = ParamSpec(infer["model.norm.weight"].layout, (18,))
    with pytest.raises(ReshardError, match=r"'model.norm.weight' has shape \(16,\) in the source and \(18,\)"):
        model_plan(train, bad)
    fused = param_specs(shapes, ParallelConfig(tp=2), num_layers=1, fusions=DEFAULT_FUSIONS)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    fused[name] = ParamSpec(fused[name].layout, (30, 16))
    with pytest.raises(ReshardError, match="qkv_proj"):
        model_plan(train, fused)


def test_bad_fusion_rules():
    with pytest.raises(ReshardError, match="distinct"):
        FusionRule("qkv", ("q",))
    with pytest.raises(ReshardError, match="bad fusion rule"):
        rules_from_data([{"parts": ["a", "b"]}])


def test_model_plan_round_trips_through_msgpack():
    from ms_layout import dumps, loads

    shapes = llama_shapes()
    weights = random_weights(shapes, seed=5)
    train = param_specs(shapes, ParallelConfig(dp=2, tp=2, optimizer_shard=True), num_layers=2)
    infer = param_specs(shapes, ParallelConfig(tp=4), num_layers=2, fusions=DEFAULT_FUSIONS)
    mp = model_plan(train, infer)
    back = loads(dumps(mp), expect="ModelPlan")
    assert back.src == mp.src and back.dst == mp.dst and len(back.moves) == len(mp.moves)
    assert back.unique_plans() == mp.unique_plans()
    a = apply_model_local(mp, _source_shards(train, weights, DEFAULT_FUSIONS))
    b = apply_model_local(back, _source_shards(train, weights, DEFAULT_FUSIONS))
    for name in a:
        for rank in a[name]:
            np.testing.assert_array_equal(a[name][rank], b[name][rank])
