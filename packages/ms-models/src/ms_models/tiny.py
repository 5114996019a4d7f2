"""Tiny seeded checkpoints with an offline tokenizer, for tests and examples.

`make_tiny(arch, path, seed)` writes an HF directory that transformers, vLLM and `from_pretrained`
read as is: config.json, model.safetensors, tokenizer.json (a byte-level BPE trained with the
`tokenizers` library on the small built-in corpus below, so any text encodes), tokenizer_config.json
and special_tokens_map.json. Every weight is random, including norms, biases and the router's
correction bias, so a wrongly mapped tensor shows up in the logits.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from mindspore import Tensor

from ms_layout.files import atomic_write

from .config import CONFIG_CLASSES, DecoderConfig
from .errors import ModelError

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<|endoftext|>")
"""bos, eos, pad (ids 0, 1, 2), and Qwen2's default unk token (id 3: transformers' Qwen2Tokenizer
would otherwise append it past the model's vocabulary)."""

_COMMON: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, rope_theta=10000.0),
    # Qwen2-0.5B ties its embeddings; the tiny one does too, so both head variants are exercised.
    "qwen2": dict(_COMMON, num_hidden_layers=2, num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True),
    # DeepSeek-V3's shape in miniature: 1 dense layer then MoE, 8 experts in 4 groups, top-2 of
    # 2 groups, 1 shared expert, 1 MTP module, and YaRN RoPE as in the released config
    # (factor 4 from 64 positions; mscale = mscale_all_dim = 1 so the softmax scale gets mscale^2).
    "deepseek_v3": dict(
        _COMMON,
        num_hidden_layers=3,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=1,
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
}

_CORPUS = (
    "MindSpore runs the same model in PyNative mode and compiled into a graph. "
    "A decoder layer normalises its input, attends over the previous tokens and adds the result back. "
    "Rotary position embeddings rotate pairs of query and key dimensions by an angle that grows with "
    "the position. Grouped-query attention shares one key and value head among several query heads. "
    "Multi-head latent attention caches a compressed latent instead of per-head keys and values. "
    "A mixture of experts sends each token to a few experts chosen by a router, plus shared experts. "
    "Paged attention keeps the cache in fixed-size blocks listed in a block table for every sequence. "
    "The quick brown fox jumps over the lazy dog. Hello world! 0123456789 + - * / = ( ) [ ] { } , . ; :"
)


def tiny_config(arch: str, **overrides: Any) -> DecoderConfig:
    """The tiny config of `arch` ("llama", "qwen2", "deepseek_v3"), with field overrides."""
    if not isinstance(arch, str) or arch not in TINY_CONFIGS:
        raise ModelError(f"unknown arch {arch!r}; expected one of {sorted(TINY_CONFIGS)}")
    cls = CONFIG_CLASSES[arch]
    unknown = sorted(set(overrides) - {f for f in cls.__dataclass_fields__})
    if unknown:
        raise ModelError(f"{cls.__name__} has no fields {unknown}")
    return cls(**{**TINY_CONFIGS[arch], **overrides})


def randomize(model, seed: int) -> None:
    """Give every parameter seeded random values (norm weights near 1, the rest N(0, 0.02-0.1))."""
    rng = np.random.default_rng(seed)
    for name, param in sorted(model.parameters_and_names()):
        shape = tuple(param.shape)
        if name.endswith("norm.weight"):
            value = 1.0 + rng.normal(0.0, 0.1, shape)
        elif name.endswith(("bias", "e_score_correction_bias")):
            value = rng.normal(0.0, 0.1, shape)
        else:
            value = rng.normal(0.0, model.config.initializer_range * 5, shape)
        param.set_data(Tensor(value.astype(np.float32)))


def build_tokenizer(vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` trained on the built-in corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS], trainer=trainer)
    # Prepend <s> like Llama's tokenizer, so a text prompt starts with bos.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    return tokenizer


def save_tokenizer(directory: str, vocab_size: int, max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ModelError(f"vocab_size={vocab_size} cannot hold a byte-level tokenizer (needs >= 259)")
    tokenizer = build_tokenizer(vocab_size)
    specials = {
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "unk_token": SPECIAL_TOKENS[3],
    }
    files = {
        "tokenizer.json": tokenizer.to_str(),
        "tokenizer_config.json": json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length, **specials}, indent=2
        ),
        "special_tokens_map.json": json.dumps(specials, indent=2),
    }
    for name, text in files.items():
        atomic_write(os.path.join(directory, name), text)


def make_tiny(arch: str, path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Write a tiny random `arch` checkpoint with its tokenizer to `path`; returns the path."""
    from .io import from_config, save_safetensors, write_manifest

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ModelError(f"seed={seed!r}; expected a non-negative int")
    config = tiny_config(arch, **overrides)
    model = from_config(config, seed=seed)
    randomize(model, seed)
    directory = os.fspath(path)
    save_safetensors(model, directory)
    save_tokenizer(directory, config.vocab_size, config.max_position_embeddings)
    write_manifest(directory, ["tokenizer.json"])
    return directory
