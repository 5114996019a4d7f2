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
    shapes["model.layers.4.eh_proj.weight"] = (16, 32)  # an MTP layer: numbered after the decoder
    return shapes


@pytest.mark.parametrize(
    "config",
    [
        ParallelConfig(dp=4, tp=2, pp=2, ep=2),
        ParallelConfig(dp=2, tp=1, pp=2, ep=2, vpp=2, optimizer_shard=True),
        ParallelConfig(dp=2, cp=2, tp=2, ep=4, order="tp-ep-cp-dp-pp"),
    ],
)
def test_shifted_layouts_equal_direct_placements(config):
    shapes = moe_shapes()
    specs = param_specs(shapes, config, num_layers=4, num_experts=8)
    for name, shape in shapes.items():
        direct = param_placement(config, name, len(shape), 4, 8).layout
        if config.optimizer_shard:
            direct = stored_layout(direct, shape)
        assert specs[name].layout == direct, name


def test_unknown_names_are_named():
    with pytest.raises(ReshardError, match="model.layers.0.weird.weight"):
        param_specs({"model.layers.0.weird.weight": (4, 4)}, ParallelConfig(tp=2), num_layers=1)
