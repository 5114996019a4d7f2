"""The tensor/expert-parallel plan of one worker: which slice of every weight a rank holds.

vLLM's options decide the split, as they do for its own models:
- `tensor_parallel_size=t` runs t worker processes. Attention is split by heads (column-parallel
  q/k/v, MLA's q_b/kv_b; row-parallel o_proj), dense MLPs by their intermediate width
  (column-parallel gate/up, row-parallel down), the embedding and the LM head by vocabulary rows
  (Megatron's vocab-parallel layers). Norms, MLA's latent projections (q_a, kv_a) and the MoE router
  are replicated; so is MLA's latent KV cache, which every head reads.
- MoE layers: without `enable_expert_parallel` every routed and shared expert is split like a dense
  MLP (TP inside each expert); with it the routed experts are split whole across the same t ranks
  (EP = t, as in vLLM where EP takes over the TP ranks of the MoE layers), shared experts stay TP.
  Either way one all-reduce per MoE layer sums the partial outputs.

The layouts themselves come from ms-layout (`ms_models.model_layouts` over an
`ms_layout.ParallelConfig`): tp=t for the dense weights and, under EP, dp=t, ep=t for the experts,
two meshes over the same t ranks in which rank r has tp=r and ep=r. This module is numpy-only: the
plan is checked against config.json before any process starts, so a size that does not split names
itself at `LLM(...)` time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


class ParallelError(ValueError):
    """A parallel setting ms-vllm cannot run (the message names the value and the option)."""


@dataclass(frozen=True)
class ShardPlan:
    """How the model of one worker process is split across vLLM's tensor-parallel ranks."""

    tp: int
    """Tensor-parallel size (vLLM's tensor_parallel_size); also the EP size under expert parallel."""
    rank: int
    """This worker's rank in the tensor-parallel group (vLLM's rank; pp = dp = 1)."""
    expert_parallel: bool = False
    """Routed experts split whole across the ranks (vLLM's enable_expert_parallel) instead of TP inside each."""

    def __post_init__(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ParallelError(f"tensor_parallel_size={self.tp!r}; expected a positive int")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.tp:
            raise ParallelError(f"rank={self.rank!r} is outside 0..{self.tp - 1}")

    # ------------------------------------------------------------------ meshes
    def dense_config(self):
        """ms-layout config of the attention, dense MLP, shared-expert, embedding and head weights."""
        from ms_layout import ParallelConfig

        return ParallelConfig(tp=self.tp)

    def expert_config(self):
        """ms-layout config of the routed experts: ep = tp over the same ranks under EP, else the dense one."""
        from ms_layout import ParallelConfig

        return ParallelConfig(dp=self.tp, ep=self.tp) if self.expert_parallel else self.dense_config()

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """[first, last) routed experts this rank holds."""
        if not self.expert_parallel:
            return 0, num_experts
        per = num_experts // self.tp
        return self.rank * per, (self.rank + 1) * per

    # ------------------------------------------------------------------ checks
    def check(self, hf_config: dict[str, Any]) -> None:
        """ParallelError unless every split size of this config.json divides evenly over the ranks."""
        tp, c = self.tp, hf_config
        if tp == 1:
            return
        heads = c.get("num_attention_heads")
        sizes = {
            "num_attention_heads": heads,
            "num_key_value_heads": c.get("num_key_value_heads") or heads,
            "intermediate_size": c.get("intermediate_size"),
            "vocab_size": c.get("vocab_size"),
        }
        experts = c.get("n_routed_experts")
        if experts:
            if not c.get("first_k_dense_replace"):
                del sizes["intermediate_size"]  # no dense MLP layer
            if self.expert_parallel:  # only the shared experts are TP-split
                shared = (c.get("moe_intermediate_size") or 0) * (c.get("n_shared_experts") or 0)
                if shared:
                    sizes["moe_intermediate_size * n_shared_experts"] = shared
            else:
                sizes["moe_intermediate_size"] = c.get("moe_intermediate_size")
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v % tp}
        if bad:
            detail = ", ".join(f"{k}={v}" for k, v in bad.items())
            raise ParallelError(f"tensor_parallel_size={tp} does not divide {detail}")
        if experts and self.expert_parallel:
            if experts % tp:
                raise ParallelError(f"n_routed_experts={experts} does not split over {tp} expert-parallel ranks")
            if experts // tp < 2:
                raise ParallelError(
                    f"n_routed_experts={experts} over {tp} expert-parallel ranks leaves {experts // tp} per rank;"
                    " ms-vllm needs at least 2 (use TP inside the experts: enable_expert_parallel=False)"
                )

    # ------------------------------------------------------------------ text and data forms
    def describe(self) -> str:
        moe = f"EP={self.tp} (whole experts)" if self.expert_parallel else f"TP={self.tp} inside each expert"
        return (
            f"rank {self.rank} of TP={self.tp}: heads, MLP widths and vocabulary split {self.tp} ways; "
            f"MoE {moe}; norms, router and MLA latents replicated"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"version": 1, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardPlan:
        if data.get("version") != 1:
            raise ParallelError(f"ShardPlan version {data.get('version')!r}; this ms-vllm reads version 1")
        return cls(int(data["tp"]), int(data["rank"]), bool(data["expert_parallel"]))


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
