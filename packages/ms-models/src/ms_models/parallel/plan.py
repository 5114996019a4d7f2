"""The tensor/expert-parallel plan of one rank: which slice of every weight it holds (numpy-only).

The split follows Megatron-LM and vLLM:
- attention by heads (column-parallel q/k/v, MLA's q_b/kv_b; row-parallel o_proj), dense MLPs by
  their intermediate width (column-parallel gate/up, row-parallel down), the embedding and the LM
  head by vocabulary rows (vocab-parallel; `vocab_parallel=False` keeps them whole on every rank);
- norms, MLA's latent projections (q_a, kv_a) and the MoE router replicated, and so MLA's latent cache;
- MoE layers: without `expert_parallel` every routed and shared expert is split like a dense MLP
  (TP inside each expert); with it the routed experts are split whole across the same tp ranks
  (EP = tp), shared experts stay TP. Either way the partial outputs are summed over the group;
- DP attention (`dp` > 1, tp = 1, vLLM's `--data-parallel-size N --enable-expert-parallel`): every
  rank holds attention, dense MLPs, shared experts and the vocabulary whole and serves its own
  requests (its own latent cache); the routed experts split over the dp ranks (EP = dp), and each
  MoE layer sends tokens to their experts' ranks and back by all-to-all (dispatch.py).

The layouts come from ms-layout (`ms_models.model_layouts` over an `ms_layout.ParallelConfig`):
tp=t for the dense weights and, under EP, dp=e, ep=e for the experts (e = dp x tp), two meshes over
the same ranks in which rank r has tp=r and ep=r. `check` validates a config.json dict before any process
starts, so a size that does not split names itself first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ModelError


class ParallelError(ModelError):
    """A parallel setting that cannot run on this model (the message names the value and the option)."""


@dataclass(frozen=True)
class ShardPlan:
    """How one rank's shard of the model is cut from the whole."""

    tp: int
    """Tensor-parallel size; also the EP size under expert parallel."""
    rank: int
    """This rank in the tensor-parallel group."""
    expert_parallel: bool = False
    """Routed experts split whole across the ranks (EP) instead of TP inside each expert."""
    vocab_parallel: bool = True
    """Embedding and LM head split by vocabulary rows; False keeps them whole on every rank."""
    dp: int = 1
    """Data-parallel attention ranks (each runs its own requests); the routed experts then split over
    all dp x tp ranks and travel by all-to-all (DispatchMoE). Needs expert_parallel and tp = 1."""
    dp_rank: int = 0
    """This rank in the data-parallel group."""

    def __post_init__(self) -> None:
        for name, size, rank in (("tensor_parallel_size", self.tp, "rank"), ("data_parallel_size", self.dp, "dp_rank")):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ParallelError(f"{name}={size!r}; expected a positive int")
            value = getattr(self, rank)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise ParallelError(f"{rank}={value!r} is outside 0..{size - 1}")
        if self.dp > 1 and not self.expert_parallel:
            raise ParallelError(
                f"data_parallel_size={self.dp} without expert parallel: DP attention shards only the experts"
                " (enable_expert_parallel=True)"
            )
        if self.dp > 1 and self.tp > 1:
            raise ParallelError(
                f"data_parallel_size={self.dp} with tensor_parallel_size={self.tp}: DP attention runs with TP = 1"
            )

    @property
    def ep(self) -> int:
        """Expert-parallel size: dp x tp under expert parallel, else 1."""
        return self.dp * self.tp if self.expert_parallel else 1

    @property
    def ep_rank(self) -> int:
        """This rank in the expert-parallel group (dp_rank x tp + rank)."""
        return self.dp_rank * self.tp + self.rank if self.expert_parallel else 0

    # ------------------------------------------------------------------ meshes
    def dense_config(self):
        """ms-layout config of the attention, dense MLP, shared-expert, embedding and head weights."""
        from ms_layout import ParallelConfig

        return ParallelConfig(tp=self.tp)

    def expert_config(self):
        """ms-layout config of the routed experts: ep = tp over the same ranks under EP, else the dense one."""
        from ms_layout import ParallelConfig

        return ParallelConfig(dp=self.ep, ep=self.ep) if self.expert_parallel else self.dense_config()

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """[first, last) routed experts this rank holds."""
        if not self.expert_parallel:
            return 0, num_experts
        per = num_experts // self.ep
        return self.ep_rank * per, (self.ep_rank + 1) * per

    # ------------------------------------------------------------------ checks
    def check(self, hf_config: dict[str, Any]) -> None:
        """ParallelError unless every split size of this config.json divides evenly over the ranks."""
        tp, c = self.tp, hf_config
        experts = c.get("n_routed_experts")
        if self.dp > 1 and not experts:
            raise ParallelError(
                f"data_parallel_size={self.dp} with expert parallel on a model without routed experts"
                " (a dense model's DP ranks are independent replicas: no plan)"
            )
        if tp == 1:
            self._check_experts(experts)
            return
        heads = c.get("num_attention_heads")
        sizes = {
            "num_attention_heads": heads,
            "num_key_value_heads": c.get("num_key_value_heads") or heads,
            "intermediate_size": c.get("intermediate_size"),
        }
        if self.vocab_parallel:
            sizes["vocab_size"] = c.get("vocab_size")
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
        self._check_experts(experts)

    def _check_experts(self, experts) -> None:
        if not (experts and self.expert_parallel and self.ep > 1):
            return
        ep = self.ep
        if experts % ep:
            raise ParallelError(f"n_routed_experts={experts} does not split over {ep} expert-parallel ranks")
        if experts // ep < 2:
            raise ParallelError(
                f"n_routed_experts={experts} over {ep} expert-parallel ranks leaves {experts // ep} per rank;"
                " the expert-parallel MoE needs at least 2 (split inside the experts instead: expert_parallel=False)"
            )

    # ------------------------------------------------------------------ text and data forms
    def describe(self) -> str:
        """One line: what this rank holds."""
        if self.dp > 1:
            return (
                f"rank {self.ep_rank} of DP={self.dp} x EP={self.ep}: attention, dense MLPs, shared experts and"
                f" vocabulary whole, its own requests and latent cache; routed experts {self.ep} ways, tokens"
                " dispatched and combined by all-to-all"
            )
        moe = f"EP={self.tp} (whole experts)" if self.expert_parallel else f"TP={self.tp} inside each expert"
        vocab = "vocabulary split" if self.vocab_parallel else "embedding and head whole"
        return (
            f"rank {self.rank} of TP={self.tp}: heads and MLP widths split {self.tp} ways, {vocab}; "
            f"MoE {moe}; norms, router and MLA latents replicated"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"version": 1, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardPlan:
        if data.get("version") != 1:
            raise ParallelError(f"ShardPlan version {data.get('version')!r}; this ms-models reads version 1")
        return cls(
            int(data["tp"]), int(data["rank"]), bool(data["expert_parallel"]), bool(data.get("vocab_parallel", True)),
            int(data.get("dp", 1)), int(data.get("dp_rank", 0)),
        )  # fmt: skip


__all__ = ["ParallelError", "ShardPlan"]
