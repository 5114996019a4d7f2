"""Logits match Hugging Face transformers loaded from the same directory (float32, CPU torch)."""

import numpy as np
import pytest
from conftest import ARCHS, hf_model, random_ids, rel_err

from ms_layout.testing import UNIT_ROUNDOFF as U
from ms_layout.testing import assert_close

pytestmark = [pytest.mark.needs_torch, pytest.mark.needs_mindspore]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, tiny_dirs, tiny_models):
    import mindspore as ms
    import torch

    ids = random_ids(2, 24, seed=1)
    ours = tiny_models[arch](ms.Tensor(ids)).asnumpy()
    with torch.no_grad():
        ref = hf_model(tiny_dirs[arch])(torch.from_numpy(ids).long()).logits.numpy()
    assert ours.shape == (2, 24, 320)
    assert rel_err(ours, ref) < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_text_prompt_through_autotokenizer(arch, tiny_dirs, tiny_models):
    import mindspore as ms
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dirs[arch])
    ids = tokenizer("Paged attention keeps the cache in blocks.")["input_ids"]
    assert max(ids) < 320 and tokenizer.decode(ids, skip_special_tokens=True).startswith("Paged attention")
    ids = np.asarray([ids], np.int32)
    ours = tiny_models[arch](ms.Tensor(ids)).asnumpy()
    with torch.no_grad():
        ref = hf_model(tiny_dirs[arch])(torch.from_numpy(ids).long()).logits.numpy()
    assert rel_err(ours, ref) < 1e-4


def test_moe_dispatch_equals_dense(tiny_dirs):
    import mindspore as ms

    from ms_models import from_pretrained

    model = from_pretrained(tiny_dirs["deepseek_v3"])
    ids = ms.Tensor(random_ids(2, 16, seed=2))
    dense = model(ids).asnumpy()
    model.set_moe_impl("dispatch")
    # the same experts' math, on gathered tokens (other matmul shapes, so possibly other kernels) and
    # combined in another order: rounding relative to the logits' scale. In each of the 2 MoE layers
    # sums over the hidden size (64), an expert's width (32) and the 3 experts combined, then the
    # head's over 64: n ~ 2 * (64 + 32 + 3) + 64 < 256 (measured here: bit-identical)
    assert_close(model(ids).asnumpy(), dense, 256 * U, "dispatch vs dense logits")


VARIANTS = {
    "llama-llama3-rope-biases": (
        "llama",
        dict(
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama-linear-rope-mha": (
        "llama",
        dict(num_key_value_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    # DeepSeek-V2-Lite style: full q_proj, no YaRN, rotate-half RoPE, two shared experts, no group limit.
    "deepseek-no-q-lora": (
        "deepseek_v3",
        dict(q_lora_rank=None, rope_scaling=None, rope_interleave=False, n_shared_experts=2, n_group=1, topk_group=1),
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_transformers(variant, tmp_path):
    import mindspore as ms
    import torch

    from ms_models import from_pretrained, make_tiny

    arch, overrides = VARIANTS[variant]
    path = make_tiny(arch, tmp_path / variant, seed=3, **overrides)
    ids = random_ids(2, 40, seed=4)  # past original_max_position_embeddings, where scaling matters
    ours = from_pretrained(path)(ms.Tensor(ids)).asnumpy()
    with torch.no_grad():
        ref = hf_model(path)(torch.from_numpy(ids).long()).logits.numpy()
    assert rel_err(ours, ref) < 1e-4
