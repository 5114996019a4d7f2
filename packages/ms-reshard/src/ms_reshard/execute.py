"""The online executor: reshard a model's MindSpore parameters between live processes.

Every rank calls ``reshard_parameters`` with the same ModelPlan and its own parameters. Shards
cross between MindSpore and the process group without copies (``Tensor.asnumpy()`` shares memory
on CPU, and ms_layout.comm wraps numpy buffers zero-copy), and the results are written into the
target Parameters in place -- ``copy_`` when the shape is unchanged, ``set_data`` when it changes.
In-place arithmetic (``add_``, ...) would silently do nothing on CPU (docs/mindspore-cpu.md
§10.3), which is why only those two are used. All writes wait until every move
has run, so a parameter that is both a source and a target is never read after being replaced.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import ReshardError
from .exchange import DEFAULT_BUCKET, make_groups, run_plans
from .model_plan import ModelPlan


def _numpy(value: Any) -> np.ndarray:
    """A numpy view of a MindSpore Tensor/Parameter (shared memory on CPU) or an ndarray."""
    return value if isinstance(value, np.ndarray) else value.asnumpy()


def np_dtype(name: str) -> np.dtype:
    """numpy dtype of a dtype name; bfloat16 through ml_dtypes (what MindSpore's asnumpy returns)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def _along(dim: int, start: int, size: int) -> tuple:
    return (slice(None),) * dim + (slice(start, start + size), Ellipsis)


def check_local(model_plan: ModelPlan, rank: int, src: Mapping[str, Any], dst: Mapping[str, Any]) -> None:
    """Before any communication: this rank has every source shard and target parameter the plan
    needs, with the source shapes the layouts give (an error here names the parameter)."""
    for name, spec in model_plan.src.items():
        if rank in spec.layout.ranks and any(m.src_name == name for m in model_plan.moves):
            if name not in src:
                raise ReshardError(f"rank {rank} holds {name!r} in the source layout but it was not given")
            want = spec.layout.shard_shape(spec.shape)
            if tuple(src[name].shape) != want:
                raise ReshardError(f"rank {rank}: {name!r} has shape {tuple(src[name].shape)}; its layout gives {want}")
    for name, spec in model_plan.dst.items():
        if rank in spec.layout.ranks and name not in dst:
            raise ReshardError(f"rank {rank} holds {name!r} in the target layout but no Parameter was given for it")


def reshard_parameters(
    model_plan: ModelPlan,
    group,
    src: Mapping[str, Any],
    dst: Mapping[str, Any],
    collectives: bool | None = None,
    bucket_bytes: int | None = DEFAULT_BUCKET,
) -> dict[str, np.ndarray]:
    """Run `model_plan` on this rank: read the source shards `src` ({name: Tensor/Parameter/ndarray}),
    write the target Parameters `dst` ({name: Parameter}) in place; returns the new shards as numpy.
    Moves run in buckets of about `bucket_bytes` of traffic per rank, one message batch per round
    of a bucket (exchange.run_plans).

    `collectives=None` runs the plan's collectives as collectives except on gloo, where they run
    as the point-to-point transfers they stand for (same bytes): torch's gloo ``new_group`` with
    local synchronization deadlocks when overlapping groups are created (measured with torch
    2.13: ranks 1,2 then 1,3 and 0,2), while batched point-to-point needs no groups at all."""
    import mindspore as ms

    rank = int(group.ranks[group.rank])
    if collectives is None:
        collectives = getattr(group, "backend", "gloo") != "gloo"
    check_local(model_plan, rank, src, dst)
    subgroups = make_groups((m.plan for m in model_plan.moves), group) if collectives else {}
    results: dict[str, np.ndarray] = {}
    items = []
    for move in model_plan.moves:
        p, s_spec, d_spec = move.plan, model_plan.src[move.src_name], model_plan.dst[move.dst_name]
        part_src = part_out = None
        if rank in p.src.ranks:
            n = p.src.shard_shape(p.shape)[move.dim] if p.shape else 0
            whole = _numpy(src[move.src_name])
            part_src = whole[_along(move.dim, move.src_offset, n)] if p.shape else whole
        if rank in p.dst.ranks:
            if move.dst_name not in results:
                local = d_spec.layout.shard_shape(d_spec.shape)
                results[move.dst_name] = np.empty(local, dtype=np_dtype(d_spec.dtype))
            n = p.dst.shard_shape(p.shape)[move.dim] if p.shape else 0
            whole = results[move.dst_name]
            part_out = whole[_along(move.dim, move.dst_offset, n)] if p.shape else whole
        items.append((p, part_src, part_out, np_dtype(s_spec.dtype)))
    run_plans(items, group, subgroups, collectives, bucket_bytes)
    for name, value in results.items():
        param = dst[name]
        if tuple(param.shape) == value.shape and _numpy(param).dtype == value.dtype:
            param.copy_(ms.Tensor.from_numpy(value))
        else:
            param.set_data(ms.Tensor.from_numpy(value))
    return results
