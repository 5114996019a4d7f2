"""A tensor/expert-parallel ms-models model: one rank's shard, with the collectives of Megatron's layers.

`build_tp_model(path, plan, group)` builds the ms-models model of a *local* config (heads, MLP
widths and vocabulary divided by tp; under EP, the rank's routed experts only), swaps in the few
cells that need a collective, and loads only this rank's slices of the safetensors, cut by the
ms-layout layouts of `ms_models.model_layouts` (parallel.py). The collectives go through the
ms_layout.comm group (gloo on CPU) on numpy arrays:

    column-parallel q/k/v, gate/up    no communication (each rank owns whole heads / columns)
    row-parallel o_proj, down_proj    all-reduce of the partial sums, then the bias once
    MoE layer                         router replicated; routed (EP: own experts; TP: own columns)
                                      plus shared-expert partials, one all-reduce per layer
    vocab-parallel embedding          rows outside the rank's vocabulary slice are zero; all-reduce
    vocab-parallel LM head            local logits, all-gather along the vocabulary

Per decoder layer that is two all-reduces of [tokens, hidden], as in Megatron-LM. Run eagerly
(`enforce_eager`), a collective is a host call between two ops; compiled, the cells are switched to
`defer` mode (`defer_collectives`) and return their partial sums, and compiled_tp.py runs the
graphs between the collectives and the collectives themselves.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from ms_models import linear

from .parallel import ParallelError, ShardPlan

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def all_reduce(x: Tensor, group) -> Tensor:
    """Sum of x over the group (a copy: the result never aliases MindSpore's buffer)."""
    arr = np.array(x.asnumpy(), copy=True)
    group.all_reduce(arr)
    return Tensor.from_numpy(arr)


class RowParallelLinear(nn.Cell):
    """y = all_reduce(x_local W_local^T) + b: W split along its input dim, b added once after the sum."""

    defer = False
    """True: return the partial sum x_local W_local^T (the caller all-reduces and adds the bias)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group):
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.weight = Parameter(Tensor(np.zeros((out_features, in_features), np.float32)), name="weight")
        self.bias = Parameter(Tensor(np.zeros(out_features, np.float32)), name="bias") if bias else None

    @classmethod
    def like(cls, linear, group) -> RowParallelLinear:
        """The row-parallel twin of an ms-models Linear already sized for one rank."""
        return cls(linear.in_features, linear.out_features, linear.bias is not None, group)

    def construct(self, x):
        y = linear(x, self.weight)
        if self.defer:
            return y
        y = all_reduce(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Cell):
    """Rows [rank * V/tp, (rank + 1) * V/tp) of the table; other ids read zeros, the all-reduce fills them."""

    defer = False
    """True: return this rank's rows only (the caller all-reduces)."""

    def __init__(self, rows: int, hidden: int, rank: int, group):
        super().__init__()
        self.rows, self.start, self.group = rows, rank * rows, group
        self.weight = Parameter(Tensor(np.zeros((rows, hidden), np.float32)), name="weight")

    def construct(self, ids):
        local = ids - self.start
        mine = ops.logical_and(local >= 0, local < self.rows)
        x = ops.gather(self.weight, ops.where(mine, local, ops.zeros_like(local)), 0)
        x = x * mine.expand_dims(-1).astype(x.dtype)
        return x if self.defer else all_reduce(x, self.group)


class ParallelMoE(nn.Cell):
    """DeepSeekMoE over the ranks: the full router on every rank, this rank's routed experts (EP) or
    expert columns (TP) and its shared-expert columns, one all-reduce of the summed partials.

    Keeps the attribute names of ms-models' MoE (gate, experts, shared_experts), so the parameter
    names, and with them the checkpoint names, stay the same."""

    defer = False
    """True: return the partial sum (the caller all-reduces)."""

    def __init__(self, moe, full_config, plan: ShardPlan, group):
        super().__init__()
        c, tp = full_config, plan.tp
        self.group, self.impl, self.ep = group, moe.impl, plan.expert_parallel
        self.experts = moe.experts
        if self.ep:
            # The local config gave the router only this rank's experts; routing needs all of them.
            self.gate = type(moe.gate)(c)
            shared = None
            if moe.shared_experts is not None:
                width = c.moe_intermediate_size * c.n_shared_experts // tp
                shared = type(moe.shared_experts)(c.hidden_size, width, False, c.initializer_range)
            self.shared_experts = shared
        else:
            self.gate, self.shared_experts = moe.gate, moe.shared_experts
        self.first, _ = plan.expert_range(c.n_routed_experts)
        self.n_local = moe.experts.num_experts

    def construct(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat)  # global expert ids
        if self.ep:
            # Another rank's expert gets weight 0 here (and index 0, any valid one): its rank adds it.
            local = indices - self.first
            mine = ops.logical_and(local >= 0, local < self.n_local)
            weights = ops.where(mine, weights, ops.zeros_like(weights))
            indices = ops.where(mine, local, ops.zeros_like(local))
        if self.impl == "dispatch":
            routed = self.experts.dispatch(flat, weights, indices)
        else:
            routed = self.experts.dense(flat, weights, indices)
        out = routed.reshape(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if self.defer else all_reduce(out, self.group)


def defer_collectives(model) -> None:
    """Switch every communicating cell of a TP model to return its partial sum (compiled_tp.py then
    runs the collectives between graphs); the model's own forward no longer communicates after this."""
    for _, cell in model.cells_and_names():
        if isinstance(cell, (RowParallelLinear, VocabParallelEmbedding, ParallelMoE)):
            cell.defer = True


def local_config(config, plan: ShardPlan):
    """The ms-models config of one rank's shard: heads, MLP widths and vocabulary divided by tp."""
    from ms_models import DeepseekV3Config, config_from_dict

    t, d = plan.tp, config.to_dict()
    d["num_attention_heads"] = config.num_attention_heads // t
    d["num_key_value_heads"] = config.num_key_value_heads // t
    d["vocab_size"] = config.vocab_size // t
    d["intermediate_size"] = max(config.intermediate_size // t, 1)
    if not isinstance(config, DeepseekV3Config):
        d["head_dim"] = config.head_dim  # otherwise derived from hidden_size / heads
        return config_from_dict(d)
    if plan.expert_parallel:
        # Only the expert count matters here: ParallelMoE brings the full router back.
        n = config.n_routed_experts // t
        d.update(n_routed_experts=n, n_group=1, topk_group=1, num_experts_per_tok=min(config.num_experts_per_tok, n))
    else:
        d["moe_intermediate_size"] = config.moe_intermediate_size // t
    return config_from_dict(d)


def shard_cells(model, full_config, plan: ShardPlan, group) -> None:
    """Swap in the cells that communicate (row-parallel linears, MoE, embedding, logits)."""
    m, c = model.model, full_config
    m.embed_tokens = VocabParallelEmbedding(c.vocab_size // plan.tp, c.hidden_size, plan.rank, group)
    layers = list(m.layers) + list(getattr(m, "mtp_layers", None) or [])
    for layer in layers:
        attn = layer.self_attn
        attn.o_proj = RowParallelLinear.like(attn.o_proj, group)
        if hasattr(layer.mlp, "experts"):
            layer.mlp = ParallelMoE(layer.mlp, full_config, plan, group)
        else:
            layer.mlp.down_proj = RowParallelLinear.like(layer.mlp.down_proj, group)
    local_logits = model.compute_logits

    def compute_logits(hidden):
        """[..., V/tp] on each rank -> [..., V], ranks' vocabulary slices in rank order."""
        part = np.ascontiguousarray(local_logits(hidden).asnumpy())
        return Tensor.from_numpy(group.all_gather(part, axis=part.ndim - 1))

    model.compute_logits = compute_logits


def _safetensor_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return [os.path.join(path, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise ParallelError(f"no *.safetensors files in {path!r}")
    return files


def read_shards(path: str, config, plan: ShardPlan) -> dict[str, np.ndarray]:
    """This rank's slice of every checkpoint tensor, read with safetensors' lazy slicing (the rest of
    each tensor is never read). Routed experts are renumbered to the rank's local indices."""
    from safetensors import safe_open

    from ms_models import model_layouts

    dense = model_layouts(config, plan.dense_config(), checkpoint=True)
    experts = model_layouts(config, plan.expert_config(), checkpoint=True) if plan.expert_parallel else dense
    first = plan.expert_range(getattr(config, "n_routed_experts", 0) or 0)[0]
    out: dict[str, np.ndarray] = {}
    for file in _safetensor_files(path):
        with safe_open(file, framework="np") as f:
            for name in f.keys():
                numbered = _EXPERT.search(name)
                placement = (experts if numbered else dense).get(name)
                lazy = f.get_slice(name)
                if placement is None:  # not ours to place: load_state_dict reports it as unexpected
                    out[name] = lazy[:]
                    continue
                layout = placement.layout
                if plan.rank not in layout.ranks:  # another EP rank's expert
                    continue
                value = lazy[layout.global_slice(tuple(lazy.get_shape()), plan.rank)]
                if numbered and plan.expert_parallel:
                    e = int(numbered.group(1)) - first
                    name = f"{name[: numbered.start()]}.experts.{e}.{name[numbered.end() :]}"
                out[name] = np.asarray(value, np.float32)
    return out


def build_tp_model(path: str, plan: ShardPlan, group):
    """The ms-models model of this rank's shard of the checkpoint at `path`, ready for forward_paged."""
    import ms_models

    config = ms_models.load_config(path)
    plan.check(config.to_dict())
    model = ms_models.from_config(local_config(config, plan))
    shard_cells(model, config, plan, group)
    ms_models.load_state_dict(model, read_shards(path, config, plan), strict=True)
    model.set_train(False)
    return model


__all__ = [
    "ParallelMoE",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "all_reduce",
    "build_tp_model",
    "defer_collectives",
    "local_config",
    "read_shards",
    "shard_cells",
]
