"""Tensor and expert parallelism for ms-models models (Megatron-style layers over `ms_layout.comm`).

One implementation for every user: ms-vllm's TP/EP workers and ms-recompute's TP training layers.

Plan
    ShardPlan(tp, rank, expert_parallel=False, vocab_parallel=True, dp=1, dp_rank=0): which slice of every weight a
    rank holds; `check(config_dict)` names a size that does not split. ParallelError (a ModelError).
Layers
    RowParallelLinear, VocabParallelEmbedding, ParallelMoE (partial sums all-reduced, or returned in
    `defer` mode: `defer_collectives(model)`), CopyToTP (Megatron's f), all_reduce; DispatchMoE
    (DP attention + EP: tokens to their experts' ranks and back by all-to-all, dispatch.py).
Sharding
    local_config(config, plan), shard_cells(model, full_config, plan, group),
    shard_tensors / read_shards (this rank's slices, lazily read), build_tp_model(path, plan, group),
    shard_model(model, plan, group).
Training
    training_shard(model, group): a dense model's TP shard that trains in PyNative (Megatron's f as
    CopiedRMSNorm, g as reduce_from_tp); training_layouts(config, parallel_config): its Layouts.
"""

from __future__ import annotations

import importlib

# Loaded on first use: `ms_models.parallel.plan` needs no MindSpore, the layers do.
_WHERE = {
    "ParallelError": "plan",
    "ShardPlan": "plan",
    "CopyToTP": "layers",
    "DispatchMoE": "layers",
    "ParallelMoE": "layers",
    "RowParallelLinear": "layers",
    "RowParallelWrapper": "layers",
    "VocabParallelEmbedding": "layers",
    "all_reduce": "layers",
    "defer_collectives": "layers",
    "build_tp_model": "shard",
    "local_config": "shard",
    "read_shards": "shard",
    "shard_cells": "shard",
    "shard_model": "shard",
    "shard_tensors": "shard",
    "reduce_from_tp": "layers",
    "CopiedRMSNorm": "training",
    "training_layouts": "training",
    "training_shard": "training",
}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ms_models.parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "CopiedRMSNorm",
    "CopyToTP",
    "DispatchMoE",
    "ParallelError",
    "ParallelMoE",
    "RowParallelLinear",
    "RowParallelWrapper",
    "ShardPlan",
    "VocabParallelEmbedding",
    "all_reduce",
    "build_tp_model",
    "defer_collectives",
    "local_config",
    "read_shards",
    "reduce_from_tp",
    "shard_cells",
    "shard_model",
    "shard_tensors",
    "training_layouts",
    "training_shard",
]
