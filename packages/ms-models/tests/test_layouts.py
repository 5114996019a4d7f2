"""Every parameter gets an ms-layout placement whose layout divides its shape."""

import pytest

from ms_layout import LayoutError, ParallelConfig, Role
from ms_models import ModelError, model_layouts, tiny_config
from ms_models.layouts import param_shapes

CONFIGS = [
    ParallelConfig(),
    ParallelConfig(tp=2, dp=2),
    ParallelConfig(tp=2, pp=3, dp=2, ep=2),
    ParallelConfig(tp=4, dp=4, ep=4, optimizer_shard=True),
]


@pytest.mark.needs_mindspore
@pytest.mark.parametrize("arch", ["llama", "qwen2", "deepseek_v3"])
def test_param_shapes_match_the_built_model(arch):
    from ms_models import from_config

    model = from_config(tiny_config(arch))
    assert param_shapes(model.config) == {n: tuple(p.shape) for n, p in model.parameters_and_names()}


@pytest.mark.parametrize("parallel", CONFIGS, ids=str)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "deepseek_v3"])
def test_every_layout_divides_its_shape(arch, parallel):
    overrides = {"num_key_value_heads": 4} if arch != "deepseek_v3" else {}
    config = tiny_config(arch, num_hidden_layers=3, **overrides)
    placements = model_layouts(config, parallel)
    shapes = param_shapes(config)
    assert set(placements) == set(shapes)
    for name, placement in placements.items():
        local = placement.layout.shard_shape(shapes[name])  # raises LayoutError if uneven
        assert all(n > 0 for n in local)


def test_roles_and_stages():
    config = tiny_config("deepseek_v3")
    parallel = ParallelConfig(tp=2, pp=3, dp=2, ep=2)
    p = model_layouts(config, parallel)
    assert p["model.embed_tokens.weight"].role is Role.VOCAB
    assert p["model.layers.1.mlp.experts.gate_proj"].role is Role.EXPERT_COLUMN
    assert p["model.layers.1.mlp.experts.down_proj"].role is Role.EXPERT_ROW
    assert p["model.layers.1.self_attn.kv_b_proj.weight"].role is Role.COLUMN
    assert p["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].role is Role.REPLICATED
    assert p["model.layers.0.self_attn.o_proj.weight"].role is Role.ROW
    assert [p[f"model.layers.{i}.input_layernorm.weight"].stage for i in range(3)] == [0, 1, 2]
    assert p["model.mtp_layers.0.eh_proj.weight"].stage == 2  # MTP sits with the head
    assert p["lm_head.weight"].stage == 2
    experts = p["model.layers.1.mlp.experts.gate_proj"].layout
    assert experts.shard_shape((8, 32, 64)) == (4, 16, 64)


@pytest.mark.parametrize(
    ("arch", "parallel", "match"),
    [
        ("llama", ParallelConfig(tp=4), "num_key_value_heads"),
        ("deepseek_v3", ParallelConfig(dp=3, ep=3), "n_routed_experts=8"),
        ("qwen2", ParallelConfig(tp=8), "num_attention_heads"),
    ],
)
def test_uneven_splits_are_refused(arch, parallel, match):
    with pytest.raises(ModelError, match=match):
        model_layouts(tiny_config(arch), parallel)


def test_not_a_model():
    with pytest.raises(ModelError, match="expected a model or a config"):
        model_layouts(object(), ParallelConfig())
    assert issubclass(LayoutError, ValueError)


@pytest.mark.needs_mindspore
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_checkpoint_names_cover_the_files(arch, tiny_dirs):
    from ms_models import load_config, read_safetensors

    tensors = read_safetensors(tiny_dirs[arch])
    config = load_config(tiny_dirs[arch])
    parallel = ParallelConfig(tp=2, dp=2, ep=2, pp=config.num_hidden_layers)
    placements = model_layouts(config, parallel, checkpoint=True)
    assert set(placements) == set(tensors)
    for name, placement in placements.items():
        placement.layout.shard_shape(tensors[name].shape)
    if arch == "deepseek_v3":
        expert = placements["model.layers.1.mlp.experts.7.gate_proj.weight"].layout
        owner = placements["model.layers.1.mlp.experts.0.gate_proj.weight"].layout
        assert set(expert.ranks).isdisjoint(owner.ranks)  # experts 0 and 7 live on different ep ranks
