"""The analytic activation memory, checked against hand counts (the measured check is in
test_memory_measured.py, which needs MindSpore)."""

from __future__ import annotations

import pytest

from ms_recompute import RecomputeError, Shape, layer_memory, megatron_bytes, model_memory, shared_bytes

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
DEEPSEEK = {
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
}


def llama_elements(b, s, h=64, a=4, g=2, d=16, inter=128):
    """6Th + 2T + 4Tr + 2Tad + 2Tgd + 2bas^2 + 4TI (the module docstring's formula, r = d)."""
    t = b * s
    return 6 * t * h + 2 * t + 4 * t * d + 2 * t * a * d + 2 * t * g * d + 2 * b * a * s * s + 4 * t * inter


@pytest.mark.parametrize("b, s", [(2, 8), (1, 16), (3, 5)])
def test_llama_layer_matches_the_closed_form(b, s):
    mem = layer_memory(LLAMA, 0, Shape(b, s))
    assert mem.total_bytes == 4 * llama_elements(b, s)
    assert mem.input_bytes == 4 * b * s * 64
    assert [m.name for m in mem.modules] == ["input_layernorm", "self_attn", "post_attention_layernorm", "mlp"]
    assert mem.module("mlp").activation_bytes == 4 * 4 * b * s * 128
    # no weight copies (ms-models' linear layers do not transpose their weights): only the
    # attention's bool mask copy
    assert mem.constant_bytes == s * s


def test_tiny_llama_layer_in_bytes_is_what_mindspore_was_measured_to_keep():
    # 77952 bytes per batch of 2 x 8 tokens: the number read off saved_tensors_hooks in MindSpore 2.10
    assert layer_memory(LLAMA, 1, Shape(2, 8)).total_bytes == 77952


def test_deepseek_dense_and_moe_layers_match_the_measured_counts():
    dense, moe, _ = model_memory(DEEPSEEK, Shape(2, 8))
    assert (dense.kind, moe.kind) == ("dense", "moe")
    assert dense.total_bytes == 93440  # measured: 243008 - 149568 bytes over two batch sizes
    assert moe.total_bytes == 182720  # 457216 - 274496
    assert dense.constant_bytes == 64  # the mask copy [8, 8]: no weight copies
    assert moe.constant_bytes == 64 + 4 * 3 * 8 * 32 * 64  # and the transposed expert stacks
    assert moe.module("mlp").activation_bytes == 122048


def test_tensor_parallelism_splits_heads_and_mlp_width_only():
    one, two = layer_memory(LLAMA, 0, Shape(2, 8)), layer_memory(LLAMA, 0, Shape(2, 8, tp=2))
    assert two.module("mlp").activation_bytes * 2 == one.module("mlp").activation_bytes
    assert two.module("input_layernorm").activation_bytes == one.module("input_layernorm").activation_bytes
    assert two.comm_bytes == 2 * 8 * 64 * 4 and one.comm_bytes == 0
    with pytest.raises(RecomputeError, match="tp=3 does not divide"):
        layer_memory(LLAMA, 0, Shape(2, 8, tp=3))


def test_dtype_scales_and_shared_inputs_and_megatron_for_comparison():
    fp32, bf16 = layer_memory(LLAMA, 0, Shape(2, 8)), layer_memory(LLAMA, 0, Shape(2, 8, "bfloat16"))
    assert bf16.module("mlp").activation_bytes * 2 == fp32.module("mlp").activation_bytes
    assert shared_bytes(LLAMA, Shape(2, 8)) == 2 * 16 * 8 * 4 + 64
    # sbh(34 + 5as/h) for s=8, b=2, h=64, a=4
    assert megatron_bytes(LLAMA, Shape(2, 8)) == int(8 * 2 * 64 * (34 + 5 * 4 * 8 / 64))


def test_moe_dispatch_estimate_counts_routed_rows_only():
    dense = layer_memory(DEEPSEEK, 1, Shape(2, 8), moe_impl="dense").module("mlp")
    sparse = layer_memory(DEEPSEEK, 1, Shape(2, 8), moe_impl="dispatch").module("mlp")
    assert sparse.activation_bytes < dense.activation_bytes
    experts = {t.what: t.bytes for t in dense.terms if t.what.startswith("experts")}
    routed = {t.what: t.bytes for t in sparse.terms if t.what.startswith("experts")}
    assert len(experts) == 2 and experts.keys() == routed.keys()
    for name, size in experts.items():  # 2 of 8 experts per token: a quarter of the expert rows
        assert routed[name] * 4 == size


@pytest.mark.parametrize(
    "config, index, shape, match",
    [
        ({**LLAMA, "model_type": "gpt2"}, 0, (1, 1), "not supported"),
        ({**LLAMA, "hidden_size": 0}, 0, (1, 1), "hidden_size"),
        (LLAMA, 2, (1, 1), "out of range"),
        (LLAMA, 0, (0, 1), "batch"),
    ],
)
def test_bad_configs_are_named(config, index, shape, match):
    with pytest.raises(RecomputeError, match=match):
        layer_memory(config, index, Shape(*shape))
