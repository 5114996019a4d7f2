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
Tensor and expert parallelism
    ms_models.parallel: ShardPlan, the TP/EP layers, local configs, sharded loading (its own docs).
Errors
    ModelError (a ValueError).
"""

from __future__ import annotations

import importlib

# name -> submodule. Imported on first use (PEP 562), so that `ms_models.config` and
# `ms_models.parallel.plan` load without MindSpore (vLLM's API server process checks plans with them).
_WHERE = {
    "CausalLM": "base",
    "packed_positions": "base",
    "pipeline_blocks": "blocks",
    "DecoderConfig": "config",
    "DeepseekV3Config": "config",
    "LlamaConfig": "config",
    "Qwen2Config": "config",
    "config_from_dict": "config",
    "load_config": "config",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "LlamaForCausalLM": "dense",
    "Qwen2ForCausalLM": "dense",
    "ModelError": "errors",
    "BlockAllocator": "generate",
    "generate_greedy": "generate",
    "generate_greedy_recompute": "generate",
    "from_config": "io",
    "from_pretrained": "io",
    "hf_state_dict": "io",
    "load_safetensors": "io",
    "load_state_dict": "io",
    "read_safetensors": "io",
    "save_safetensors": "io",
    "linear": "layers",
    "model_layouts": "layouts",
    "param_shapes": "layouts",
    "PagedMetadata": "paged_cache",
    "allocate_kv_caches": "paged_cache",
    "TINY_CONFIGS": "tiny",
    "make_tiny": "tiny",
    "tiny_config": "tiny",
}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ms_models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))


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
