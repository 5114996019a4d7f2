"""The dense decoder of the Llama / Qwen2 family: GQA + RoPE, RMSNorm, SwiGLU; HF module names."""

from __future__ import annotations

import numpy as np
from mindspore import nn

from .attention import Attention
from .base import CausalLM
from .config import LlamaConfig, Qwen2Config
from .layers import MLP, Embedding, RMSNorm, RotaryEmbedding


class LlamaDecoderLayer(nn.Cell):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig, rng=None):
        super().__init__()
        c = config
        self.self_attn = Attention(c, rng)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, c.mlp_bias, c.initializer_range, rng)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def construct(self, x, cos, sin, allowed):
        """x [B, S, H]; cos/sin [B, S, rope_dim/2]; allowed [B, 1, S, S]."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, allowed)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_paged(self, x, cos, sin, cache, meta):
        """x [T, H] of a flat paged batch; the layer's cache is written in place."""
        x = x + self.self_attn.forward_paged(self.input_layernorm(x), cos, sin, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Cell):
    """embed_tokens -> layers -> norm (HF `model.*`); returns the final normed hidden states."""

    def __init__(self, config, layers: list[nn.Cell], rng=None):
        super().__init__()
        c = config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, c.initializer_range, rng)
        self.layers = nn.CellList(layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(*c.rope_inv_freq())

    def construct(self, input_ids, positions, allowed):
        """input_ids/positions [B, S], allowed [B, 1, S, S] -> hidden [B, S, H]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)
        for layer in self.layers:
            x = layer(x, cos, sin, allowed)
        return self.norm(x)

    def forward_paged(self, input_ids, positions, kv_caches, meta):
        """input_ids/positions [T] -> hidden [T, H], writing every layer's paged cache."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)
        for layer, cache in zip(self.layers, kv_caches):
            x = layer.forward_paged(x, cos, sin, cache, meta)
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    """Llama decoder with an LM head (HF LlamaForCausalLM names)."""

    config_class = LlamaConfig

    def __init__(self, config: LlamaConfig, seed: int = 0):
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}")
        rng = np.random.default_rng(seed)
        layers = [LlamaDecoderLayer(config, rng) for _ in range(config.num_hidden_layers)]
        super().__init__(config, DecoderModel(config, layers, rng), rng)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama decoder with q/k/v biases (HF Qwen2ForCausalLM names)."""

    config_class = Qwen2Config
