"""param_specs: the stage/owner rank shift gives exactly ms_layout.param_placement's layouts."""

from __future__ import annotations

import pytest

from ms_layout import ParallelConfig, param_placement
from ms_reshard import ReshardError, param_specs, stored_layout


def moe_shapes(layers=4, experts=8):
    shapes = {"model.embed_tokens.weight": (64, 16), "model.norm.weight": (16,), "lm_head.weight": (64, 16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (16,), p + "self_attn.q_proj.weight": (32, 16)})
        shapes.update({p + "self_attn.o_proj.weight": (16, 32), p + "mlp.gate.weight": (experts, 16)})
        for e in range(experts):
            shapes[f"{p}mlp.experts.{e}.up_proj.weight"] = (8, 16)
            shapes[f"{p}mlp.experts.{e}.down_proj.weight"] = (16, 8)
    # an MTP layer, numbered after the decoder, with its own experts (DeepSeek-V3's layer 61)
    shapes["model.layers.4.eh_proj.weight"] = (16, 32)
    shapes["model.layers.4.shared_head.head.weight"] = (64, 16)
    shapes.update({f"model.layers.4.mlp.experts.{e}.up_proj.weight": (8, 16) for e in range(experts)})
    return shapes


@pytest.mark.parametrize(
    "config, per_chunk",
    [
        (ParallelConfig(dp=4, tp=2, pp=2, ep=2), None),
        (ParallelConfig(dp=2, tp=1, pp=2, ep=2, vpp=2, optimizer_shard=True), None),
        (ParallelConfig(dp=2, cp=2, tp=2, ep=4, order="tp-ep-cp-dp-pp"), None),
        (ParallelConfig(dp=4, tp=2, pp=4, ep=4, optimizer_shard=True), [0, 1, 1, 2]),  # stage 0: no layer
        (ParallelConfig(dp=2, tp=2, pp=2, ep=2, vpp=2), [1, 0, 2, 1]),
    ],
)
def test_shifted_layouts_equal_direct_placements(config, per_chunk):
    shapes = moe_shapes()
    specs = param_specs(shapes, config, num_layers=4, num_experts=8, layers_per_chunk=per_chunk)
    for name, shape in shapes.items():
        direct = param_placement(config, name, len(shape), 4, 8, per_chunk).layout
        if config.optimizer_shard:
            direct = stored_layout(direct, shape)
        assert specs[name].layout == direct, name


def test_expert_numbers_past_the_model_are_named():
    shapes = {"model.layers.0.mlp.experts.8.up_proj.weight": (8, 16)}
    with pytest.raises(ReshardError, match="experts.8.*outside the model's 8 experts"):
        param_specs(shapes, ParallelConfig(dp=2, ep=2), num_layers=1, num_experts=8)


def test_unknown_names_are_named():
    with pytest.raises(ReshardError, match="model.layers.0.weird.weight"):
        param_specs({"model.layers.0.weird.weight": (4, 4)}, ParallelConfig(tp=2), num_layers=1)
