"""ms-layout placements of every parameter under a ParallelConfig (TP, EP, vocab parallel, PP).

`model_layouts(model_or_config, parallel_config)` maps each parameter name of our models (the
in-memory names: stacked experts `mlp.experts.gate_proj` [E, I, H]; `model.mtp_layers.k`) to an
`ms_layout.ParamPlacement` built by `ms_layout.param_placement` from the HF-style name: column
parallel q/k/v, q_b/kv_b, gate/up; row parallel o/down; vocab parallel embedding and head; replicated
norms, router, q_a/kv_a latents; stacked experts split over ep (and tp inside each expert). MTP
modules are placed as layers num_hidden_layers + k, i.e. on the last pipeline stage with the head.

Sizes that would split a head, an expert or the vocabulary unevenly raise ModelError before any
layout is made. Shapes come from `param_shapes(config)`, so a 671B config is planned without
building it.
"""

from __future__ import annotations

import dataclasses
import re

from ms_layout import Layout, ParallelConfig, ParamPlacement, param_placement

from .config import DecoderConfig, DeepseekV3Config
from .errors import ModelError
from .io import checkpoint_names


def _linear(prefix: str, out: int, inp: int, bias: bool = False) -> dict[str, tuple[int, ...]]:
    shapes = {f"{prefix}.weight": (out, inp)}
    if bias:
        shapes[f"{prefix}.bias"] = (out,)
    return shapes


def _mlp(prefix: str, hidden: int, inter: int, bias: bool = False) -> dict[str, tuple[int, ...]]:
    return {
        **_linear(f"{prefix}.gate_proj", inter, hidden, bias),
        **_linear(f"{prefix}.up_proj", inter, hidden, bias),
        **_linear(f"{prefix}.down_proj", hidden, inter, bias),
    }


def _dense_layer(c, p: str) -> dict[str, tuple[int, ...]]:
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {
        **_linear(f"{p}.self_attn.q_proj", q, h, c.qkv_bias),
        **_linear(f"{p}.self_attn.k_proj", kv, h, c.qkv_bias),
        **_linear(f"{p}.self_attn.v_proj", kv, h, c.qkv_bias),
        **_linear(f"{p}.self_attn.o_proj", h, q, c.o_bias),
        **_mlp(f"{p}.mlp", h, c.intermediate_size, c.mlp_bias),
        f"{p}.input_layernorm.weight": (h,),
        f"{p}.post_attention_layernorm.weight": (h,),
    }


def _deepseek_layer(c: DeepseekV3Config, p: str, index: int) -> dict[str, tuple[int, ...]]:
    h, heads, bias = c.hidden_size, c.num_attention_heads, c.attention_bias
    a = f"{p}.self_attn"
    out = {}
    if c.q_lora_rank is None:
        out.update(_linear(f"{a}.q_proj", heads * c.qk_head_dim, h))
    else:
        out.update(_linear(f"{a}.q_a_proj", c.q_lora_rank, h, bias))
        out[f"{a}.q_a_layernorm.weight"] = (c.q_lora_rank,)
        out.update(_linear(f"{a}.q_b_proj", heads * c.qk_head_dim, c.q_lora_rank))
    out.update(_linear(f"{a}.kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, h, bias))
    out[f"{a}.kv_a_layernorm.weight"] = (c.kv_lora_rank,)
    out.update(_linear(f"{a}.kv_b_proj", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))
    out.update(_linear(f"{a}.o_proj", h, heads * c.v_head_dim, bias))
    if c.is_moe_layer(index):
        e, i = c.n_routed_experts, c.moe_intermediate_size
        out[f"{p}.mlp.gate.weight"] = (e, h)
        out[f"{p}.mlp.gate.e_score_correction_bias"] = (e,)
        out[f"{p}.mlp.experts.gate_proj"] = (e, i, h)
        out[f"{p}.mlp.experts.up_proj"] = (e, i, h)
        out[f"{p}.mlp.experts.down_proj"] = (e, h, i)
        if c.n_shared_experts:
            out.update(_mlp(f"{p}.mlp.shared_experts", h, i * c.n_shared_experts))
    else:
        out.update(_mlp(f"{p}.mlp", h, c.intermediate_size))
    out[f"{p}.input_layernorm.weight"] = (h,)
    out[f"{p}.post_attention_layernorm.weight"] = (h,)
    return out


def param_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the model a config builds, without building it."""
    c = config
    out = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    deepseek = isinstance(c, DeepseekV3Config)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        out.update(_deepseek_layer(c, p, i) if deepseek else _dense_layer(c, p))
    if deepseek:
        for k in range(c.num_nextn_predict_layers):
            p = f"model.mtp_layers.{k}"
            out.update(_deepseek_layer(c, p, c.num_hidden_layers + k))
            out.update({f"{p}.enorm.weight": (c.hidden_size,), f"{p}.hnorm.weight": (c.hidden_size,)})
            out[f"{p}.eh_proj.weight"] = (c.hidden_size, 2 * c.hidden_size)
            out[f"{p}.shared_head.norm.weight"] = (c.hidden_size,)
    out["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return out


def check_divisible(config: DecoderConfig, parallel: ParallelConfig, vocab_parallel: bool = True) -> None:
    """ModelError unless tp splits heads, MLP widths and (vocab-parallel) the vocabulary, and ep
    splits the experts evenly."""
    c, tp = config, parallel.tp
    sizes = {"vocab_size": c.vocab_size} if vocab_parallel else {}
    sizes["num_attention_heads"] = c.num_attention_heads
    if isinstance(c, DeepseekV3Config):
        sizes["moe_intermediate_size"] = c.moe_intermediate_size
        if c.first_k_dense_replace:
            sizes["intermediate_size"] = c.intermediate_size
        if c.n_routed_experts % parallel.ep:
            raise ModelError(f"n_routed_experts={c.n_routed_experts} does not split over ep={parallel.ep}")
    else:
        sizes.update(num_key_value_heads=c.num_key_value_heads, intermediate_size=c.intermediate_size)
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise ModelError(f"tp={tp} does not divide {bad}")


_MTP = re.compile(r"^model\.mtp_layers\.(\d+)\.")
_VOCAB = re.compile(r"(embed_tokens|lm_head|shared_head\.head)\.weight$")


def checkpoint_shapes(config: DecoderConfig, shapes: dict[str, tuple[int, ...]] | None = None):
    """Checkpoint tensor name -> shape (per-expert matrices, MTP layers renumbered, shared copies)."""
    shapes = param_shapes(config) if shapes is None else shapes
    out = {}
    for name, shape in shapes.items():
        for hub, expert in checkpoint_names(config.num_hidden_layers, name, shape):
            out[hub] = shape if expert is None else shape[1:]
    for k in range(getattr(config, "num_nextn_predict_layers", 0)):
        prefix = f"model.layers.{config.num_hidden_layers + k}"
        out[f"{prefix}.embed_tokens.weight"] = (config.vocab_size, config.hidden_size)
        out[f"{prefix}.shared_head.head.weight"] = (config.vocab_size, config.hidden_size)
    return out


def model_layouts(
    model_or_config,
    parallel_config: ParallelConfig,
    layers_per_chunk=None,
    checkpoint: bool = False,
    vocab_parallel: bool = True,
) -> dict[str, ParamPlacement]:
    """Parameter name -> ms_layout.ParamPlacement (role, pipeline stage, Layout) for every parameter.

    With `checkpoint=True` the keys are the checkpoint's tensor names instead (one matrix per
    expert, owned by the ep rank holding it; MTP as model.layers.{L + k}, with its copies of the
    shared embedding and head), for code that shards or gathers HF-format files. With
    `vocab_parallel=False` the embedding and head stay whole on every tensor-parallel rank."""
    config = getattr(model_or_config, "config", model_or_config)
    if not isinstance(config, DecoderConfig):
        raise ModelError(f"expected a model or a config, got {type(model_or_config).__name__}")
    check_divisible(config, parallel_config, vocab_parallel)
    if hasattr(model_or_config, "parameters_and_names"):
        shapes = {name: tuple(p.shape) for name, p in model_or_config.parameters_and_names()}
    else:
        shapes = param_shapes(config)
    if checkpoint:
        shapes = checkpoint_shapes(config, shapes)
    experts = getattr(config, "n_routed_experts", None)
    out = {}
    for name, shape in shapes.items():
        # ms_layout reads the layer index from the HF name: MTP module k is layer num_hidden_layers + k.
        hf_name = _MTP.sub(lambda m: f"model.layers.{config.num_hidden_layers + int(m.group(1))}.", name)
        placement = param_placement(
            parallel_config, hf_name, len(shape), config.num_hidden_layers, experts, layers_per_chunk
        )
        if not vocab_parallel and _VOCAB.search(name):
            layout = placement.layout
            whole = Layout(layout.device_matrix, layout.alias_names, tuple(() for _ in layout.dims), layout.rank_list)
            placement = dataclasses.replace(placement, layout=whole)
        out[name] = dataclasses.replace(placement, name=name)
    return out
