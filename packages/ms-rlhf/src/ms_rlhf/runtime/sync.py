"""Online weight sync with ms-reshard: from where the trainer keeps its weights to every model that
reads them.

The trainer keeps *master* weights: replicated on every DP rank, or -- with optimizer sharding --
split along dim 0 over the DP ranks (``ms_reshard.stored_layout``), each rank updating only its
shard with its share of Adam state (ZeRO). Three models read them: the training model (full
weights for forward/backward), the rollout model and the reference model. Each read is an
``ms_reshard`` ModelPlan, planned once and run after every optimizer step with
``ms_reshard.reshard_parameters``, which writes the target Parameters in place:

* one rank: source and target layouts are the same, so the plan is all local copies;
* sharded master to replicated models: the plan is an all-gather, moving exactly the bytes each
  rank lacks (ms-reshard's lower bound), one parameter at a time -- no rank ever materialises a
  second full copy of the model as the gather-everything approach does (verl #6772's OOM,
  docs/rlhf-reshard-prior-art.md §6).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ms_layout import ParallelConfig


@dataclass
class SyncStats:
    """What one sync moved."""

    seconds: float
    """Wall time."""
    received_bytes: int
    """Bytes this rank received from other ranks."""
    local_bytes: int
    """Bytes this rank copied locally."""


def layouts(config, world: int, sharded: bool, shapes: Mapping[str, tuple[int, ...]]):
    """{name: ms_reshard.ParamSpec} of every parameter, DP-replicated over `world` ranks, or split
    along dim 0 where it divides when `sharded`."""
    import ms_models
    from ms_reshard import ParamSpec, stored_layout

    parallel = ParallelConfig(dp=world, optimizer_shard=sharded)
    out = {}
    for name, placement in ms_models.model_layouts(config, parallel).items():
        layout = stored_layout(placement.layout, shapes[name]) if sharded else placement.layout
        out[name] = ParamSpec(layout, tuple(shapes[name]), "float32")
    return out


class WeightSync:
    """The plan from the master layout to the replicated model layout, made once; `run` moves one
    set of master-layout weights into one model's Parameters."""

    def __init__(self, config, group, sharded: bool):
        import ms_models
        from ms_reshard import model_plan

        self.group = group
        self.rank = int(group.ranks[group.rank])
        shapes = {k: tuple(v) for k, v in ms_models.param_shapes(config).items()}
        self.master = layouts(config, group.size, sharded, shapes)
        self.replica = layouts(config, group.size, False, shapes)
        self.to_replica = model_plan(self.master, self.replica)
        per_rank = self.to_replica.per_rank().get(self.rank, {"received": 0})
        self.received_bytes = int(per_rank["received"])
        self.total_bytes = sum(int(np.prod(s)) * 4 for s in shapes.values())

    def master_slice(self, name: str) -> tuple[slice, ...]:
        """This rank's slice of a full parameter in the master layout."""
        spec = self.master[name]
        return spec.layout.global_slice(spec.shape, self.rank)

    def run(self, src: Mapping[str, object], dst: Mapping[str, object]) -> SyncStats:
        """Move master-layout shards `src` ({name: Parameter/array}) into a model's Parameters `dst`."""
        from ms_reshard import reshard_parameters

        start = time.perf_counter()
        reshard_parameters(self.to_replica, self.group, src, dst)
        seconds = time.perf_counter() - start
        return SyncStats(seconds, self.received_bytes, self.total_bytes - self.received_bytes)
