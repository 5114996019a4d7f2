"""vLLM's parallel options checked before any worker starts.

vLLM's options decide the split, as they do for its own models: `tensor_parallel_size=t` runs t
worker processes, each holding the `ms_models.parallel.ShardPlan(t, rank, enable_expert_parallel)`
slice of every weight (attention by heads, MLPs by width, vocabulary by rows; with
`enable_expert_parallel` the routed experts whole across the same t ranks, EP = t, as in vLLM).
`data_parallel_size=d` on a model with routed experts (with `enable_expert_parallel`, tp = 1) is DP
attention + EP: d engines, each serving its own requests with the attention, dense MLPs and shared
experts whole, the routed experts split d ways and reached by all-to-all (ShardPlan's dp). On a
dense model the d engines are independent replicas. This module is numpy-only: the plan is
checked against config.json in the main process, so a size that does not split names itself at
`LLM(...)` time.
"""

from __future__ import annotations

from ms_models.parallel.plan import ParallelError, ShardPlan


def _hf_dict(model) -> dict:
    hf = model.hf_config
    return hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))


def expert_data_parallel(vllm_config) -> bool:
    """DP attention + EP: data_parallel_size > 1 on a model with routed experts (ranks exchange tokens)."""
    p, model = vllm_config.parallel_config, vllm_config.model_config
    return p.data_parallel_size > 1 and model is not None and bool(_hf_dict(model).get("n_routed_experts"))


def check_vllm_parallel(vllm_config) -> None:
    """ParallelError for the parallel settings and feature combinations ms-vllm does not run.

    Called by the platform at engine creation, in the main process, before any worker starts."""
    p = vllm_config.parallel_config
    if p.world_size == 1 and p.data_parallel_size == 1:
        return
    unsupported = {
        "pipeline_parallel_size": p.pipeline_parallel_size,
        "prefill_context_parallel_size": getattr(p, "prefill_context_parallel_size", 1),
        "decode_context_parallel_size": getattr(p, "decode_context_parallel_size", 1),
    }
    bad = {k: v for k, v in unsupported.items() if v != 1}
    if bad:
        detail = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ParallelError(f"{detail}: ms-vllm runs tensor, expert and data parallel only; these must be 1")
    backend = p.distributed_executor_backend
    if backend not in (None, "mp", "uni"):
        raise ParallelError(
            f"distributed_executor_backend={backend!r}; ms-vllm's workers run under vLLM's 'mp' executor"
        )
    tp, dp = p.tensor_parallel_size, p.data_parallel_size
    model = vllm_config.model_config
    if dp > 1 and not expert_data_parallel(vllm_config):
        # A dense model's DP ranks are independent engines: each one is checked as its own TP group.
        if tp > 1:
            raise ParallelError(f"data_parallel_size={dp} with tensor_parallel_size={tp} is not supported yet")
        return
    if model is None:
        return
    if dp > 1:
        if not p.enable_expert_parallel:
            raise ParallelError(
                f"data_parallel_size={dp} on a model with routed experts needs enable_expert_parallel=True"
                " (--enable-expert-parallel): ms-vllm splits the experts over the DP ranks (DP attention + EP)"
            )
        ShardPlan(tp, 0, True, dp=dp).check(_hf_dict(model))
        return
    ShardPlan(tp, 0, bool(p.enable_expert_parallel)).check(_hf_dict(model))


def plan_of(vllm_config, group) -> ShardPlan:
    """This worker's ShardPlan: DP attention + EP (tp = 1) when data_parallel_size > 1, else TP (and EP)."""
    p = vllm_config.parallel_config
    if p.data_parallel_size > 1:
        return ShardPlan(1, 0, True, dp=p.data_parallel_size, dp_rank=p.data_parallel_rank)
    return ShardPlan(group.size, group.rank, bool(p.enable_expert_parallel))


__all__ = ["ParallelError", "ShardPlan", "check_vllm_parallel", "expert_data_parallel", "plan_of"]
