"""vLLM's parallel options checked before any worker starts.

vLLM's options decide the split, as they do for its own models: `tensor_parallel_size=t` runs t
worker processes, each holding the `ms_models.parallel.ShardPlan(t, rank, enable_expert_parallel)`
slice of every weight (attention by heads, MLPs by width, vocabulary by rows; with
`enable_expert_parallel` the routed experts whole across the same t ranks, EP = t, as in vLLM).
This module is numpy-only: the plan is checked against config.json in the main process, so a size
that does not split names itself at `LLM(...)` time.
"""

from __future__ import annotations

from ms_models.parallel.plan import ParallelError, ShardPlan


def check_vllm_parallel(vllm_config) -> None:
    """ParallelError for the parallel settings and feature combinations ms-vllm does not run.

    Called by the platform at engine creation, in the main process, before any worker starts."""
    p = vllm_config.parallel_config
    if p.world_size == 1 and p.data_parallel_size == 1:
        return
    unsupported = {
        "pipeline_parallel_size": p.pipeline_parallel_size,
        "data_parallel_size": p.data_parallel_size,
        "prefill_context_parallel_size": getattr(p, "prefill_context_parallel_size", 1),
        "decode_context_parallel_size": getattr(p, "decode_context_parallel_size", 1),
    }
    bad = {k: v for k, v in unsupported.items() if v != 1}
    if bad:
        detail = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ParallelError(f"{detail}: ms-vllm runs tensor (and expert) parallel only; these must be 1")
    backend = p.distributed_executor_backend
    if backend not in (None, "mp"):
        raise ParallelError(
            f"distributed_executor_backend={backend!r}; ms-vllm's workers run under vLLM's 'mp' executor"
        )
    # Features whose per-rank state is not split yet: refuse rather than produce wrong tokens.
    tp = p.tensor_parallel_size
    if vllm_config.lora_config is not None:
        raise ParallelError(f"enable_lora with tensor_parallel_size={tp}: LoRA adapters are not sharded yet")
    if vllm_config.speculative_config is not None:
        raise ParallelError(f"speculative decoding (MTP) with tensor_parallel_size={tp} is not supported yet")
    if vllm_config.model_config is not None and vllm_config.model_config.quantization:
        method = vllm_config.model_config.quantization
        raise ParallelError(f"quantization={method!r} with tensor_parallel_size={tp} is not supported yet")
    model = vllm_config.model_config
    if model is not None:
        hf = model.hf_config.to_dict() if hasattr(model.hf_config, "to_dict") else dict(vars(model.hf_config))
        ShardPlan(tp, 0, bool(p.enable_expert_parallel)).check(hf)


__all__ = ["ParallelError", "ShardPlan", "check_vllm_parallel"]
