"""ms-models: reference MindSpore decoder models with Hugging Face weight names.

Models
    LlamaForCausalLM, Qwen2ForCausalLM (dense: GQA + RoPE, RMSNorm, SwiGLU) and
    DeepseekV3ForCausalLM (MLA, DeepSeekMoE, MTP). `model.model.embed_tokens`,
    `model.model.layers[i]`, `model.model.norm`, `model.lm_head` (None when tied) as in HF.
    `model(ids [B, S], positions=None, segment_ids=None) -> logits [B, S, V]` (training path),
    `model.forward_packed(ids, cu_seqlens)`, and `model.forward_paged(...)` (paged-KV inference);
    DeepSeek-V3 also `mtp_forward(...)` and `mtp_forward_paged(...)` for its MTP modules.
Configs
    LlamaConfig, Qwen2Config, DeepseekV3Config (HF config.json fields), load_config, tiny_config.
Checkpoints
    from_pretrained(path), from_config(config, seed), load_safetensors(model, path),
    save_safetensors(model, path), hf_state_dict(model), make_tiny(arch, path, seed).
Paged cache
    model.forward_paged(...), model.allocate_kv_caches(...), PagedMetadata,
    allocate_kv_caches(model, num_blocks, block_size), generate_greedy(model, prompts, n),
    generate_greedy_recompute(model, prompt, n), BlockAllocator.
Pipeline blocks
    pipeline_blocks(model) -> [embed, layer 0..n-1, head] Cells (HF names kept) for a pipeline runtime.
Parallel layouts
    model_layouts(model_or_config, parallel_config) -> {param name: ms_layout.ParamPlacement},
    param_shapes(config) -> {param name: shape} (no model built).
Errors
    ModelError (a ValueError).
"""

from __future__ import annotations

from .base import CausalLM, packed_positions
from .blocks import pipeline_blocks
from .config import DecoderConfig, DeepseekV3Config, LlamaConfig, Qwen2Config, config_from_dict, load_config
from .deepseek_v3 import DeepseekV3ForCausalLM
from .dense import LlamaForCausalLM, Qwen2ForCausalLM
from .errors import ModelError
from .generate import BlockAllocator, generate_greedy, generate_greedy_recompute
from .io import (
    from_config,
    from_pretrained,
    hf_state_dict,
    load_safetensors,
    load_state_dict,
    read_safetensors,
    save_safetensors,
)
from .layers import linear
from .layouts import model_layouts, param_shapes
from .paged_cache import PagedMetadata, allocate_kv_caches
from .tiny import TINY_CONFIGS, make_tiny, tiny_config

__version__ = "0.1.0"

__all__ = [
    "TINY_CONFIGS",
    "BlockAllocator",
    "CausalLM",
    "DecoderConfig",
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "LlamaConfig",
    "LlamaForCausalLM",
    "ModelError",
    "PagedMetadata",
    "Qwen2Config",
    "Qwen2ForCausalLM",
    "allocate_kv_caches",
    "config_from_dict",
    "from_config",
    "from_pretrained",
    "generate_greedy",
    "generate_greedy_recompute",
    "hf_state_dict",
    "linear",
    "load_config",
    "load_safetensors",
    "load_state_dict",
    "make_tiny",
    "model_layouts",
    "packed_positions",
    "param_shapes",
    "pipeline_blocks",
    "read_safetensors",
    "save_safetensors",
    "tiny_config",
]
