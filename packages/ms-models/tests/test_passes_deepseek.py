"""The explicit passes of DeepSeek-V3 (MLA, DeepSeekMoE, its decoder layers and pipeline blocks),
compiled with mindspore.jit, give the plain module's output, input gradient and weight gradients
(ms.grad of the module in PyNative)."""

import numpy as np
import pytest
from _passes_check import _angles, _check, _tensor

pytestmark = [pytest.mark.needs_mindspore, pytest.mark.usefixtures("kernels")]  # plain and fused

CONFIGS = {
    # q LoRA, interleaved RoPE, normalised top-k weights, one shared expert (the tiny default)
    "default": {},
    # q_proj instead of q LoRA, biases on q_a/kv_a/o, HF rotate-half RoPE, raw top-k weights, no shared expert
    "variant": dict(
        q_lora_rank=None, attention_bias=True, rope_interleave=False, norm_topk_prob=False, n_shared_experts=0
    ),
}


def _model(name, seed=3):
    from ms_models import DeepseekV3ForCausalLM, tiny_config
    from ms_models.tiny import randomize

    cfg = tiny_config("deepseek_v3", num_hidden_layers=2, num_nextn_predict_layers=0, **CONFIGS[name])
    model = DeepseekV3ForCausalLM(cfg, seed=seed)
    randomize(model, seed)  # norms away from 1, non-zero biases and correction bias: every term shows
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mla_passes(name):
    from ms_models.passes import MLAPasses

    model = _model(name)
    attn = model.model.layers[0].self_attn
    assert attn.q_lora == (name == "default") and attn.interleave == (name == "default")
    cos, sin, allowed = _angles(model, [list(range(7)), list(range(3, 10))])
    x = _tensor((2, 7, model.config.hidden_size), 1)
    _check(MLAPasses(attn), attn, (x, cos, sin, allowed), (cos, sin), f"MLA[{name}]")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_passes(name):
    from ms_models.moe import MoE
    from ms_models.passes import MoEPasses

    model = _model(name)
    moe = model.model.layers[1].mlp
    assert isinstance(moe, MoE) and moe.impl == "dense"
    x = _tensor((2, 7, model.config.hidden_size), 2)
    _, indices = moe.gate(x.reshape(-1, x.shape[-1]))
    assert len(np.unique(indices.asnumpy())) > 2, "routing picks too few experts for a meaningful check"
    _check(MoEPasses(moe), moe, (x,), (), f"MoE[{name}]")


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("index", [0, 1])  # first_k_dense_replace = 1: a dense-MLP layer, then a MoE layer
def test_decoder_layer_passes(name, index):
    from ms_models.passes import DecoderLayerPasses

    model = _model(name)
    layer = model.model.layers[index]
    assert type(layer.mlp).__name__ == ("MLP" if index == 0 else "MoE")
    cos, sin, allowed = _angles(model, [list(range(6))] * 2)
    x = _tensor((2, 6, model.config.hidden_size), 4)
    _check(DecoderLayerPasses(layer), layer, (x, cos, sin, allowed), (cos, sin), f"layer {index}[{name}]")


def test_decoder_layer_passes_packed():
    """Two samples packed in one row: RoPE positions restart, attention stays within each sample."""
    from ms_models.passes import DecoderLayerPasses

    model = _model("default")
    layer = model.model.layers[1]
    positions, segments = [list(range(4)) + list(range(5))], [[0] * 4 + [1] * 5]
    cos, sin, allowed = _angles(model, positions, segments)
    assert not allowed.asnumpy()[0, 0, 5, 2]  # the second sample does not see the first
    x = _tensor((1, 9, model.config.hidden_size), 5)
    _check(DecoderLayerPasses(layer), layer, (x, cos, sin, allowed), (cos, sin), "packed layer 1")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layer_block_passes(name):
    from ms_models.blocks import LayerBlock, pipeline_blocks
    from ms_models.passes import LayerBlockPasses

    model = _model(name, seed=5)
    blocks = [b for b in pipeline_blocks(model) if isinstance(b, LayerBlock)]
    assert len(blocks) == 2
    for k, block in enumerate(blocks):
        x = _tensor((2, 5, model.config.hidden_size), 6 + k)
        _check(LayerBlockPasses(block), block, (x,), (), f"block {k}[{name}]")
