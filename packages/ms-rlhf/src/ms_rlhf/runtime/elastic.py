"""Resume a checkpoint on another number of ranks, or with optimizer sharding switched: its shards
resharded by ms-reshard, each rank reading only what it keeps.

A checkpoint holds, per rank, the rank's master weights, reference weights and Adam moments in the
master layout of the run that wrote it (replicated over its DP ranks, or split along dim 0 with
optimizer sharding: ``sync.layouts``), and replicated scalars (Adam's step, beta powers, learning
rate). A run on M ranks resuming one of N ranks plans the move from the N-rank layouts to its own
with ``ms_reshard.model_plan`` and reads its shards with ``ms_reshard.read_rank``: every piece
comes straight from the old rank file that holds it, as a lazy safetensors slice, so no rank loads
another rank's whole file or the whole model. The reference weights move the same way.

What a resumed run continues exactly: the weights, the Adam state, the data cursor, the RNG states
and the rollouts (sampling is keyed by (seed, step, request), wherever a request runs). What the
new world size changes: how the micro-batches split over the ranks and the order in which their
gradients add up, so losses continue within float32 summation-order error of the old run's, not
bit for bit (docs/ms-rlhf.md, "Elastic resume").
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from .. import checkpoint
from ..errors import CheckpointError
from .pipelined import build_schedule, owners
from .sync import layouts

#: prefixes of the checkpoint keys stored in the master layout (the rest are replicated scalars)
SHARDED_PREFIXES = ("master.", "ref.", "optim.moment1.master.", "optim.moment2.master.")


def split_keys(keys, names) -> tuple[dict[str, str], list[str]]:
    """({key: parameter name} of the keys held in the master layout, [replicated keys])."""
    sharded, replicated = {}, []
    for key in keys:
        for prefix in SHARDED_PREFIXES:
            if key.startswith(prefix) and key[len(prefix) :] in names:
                sharded[key] = key[len(prefix) :]
                break
        else:
            replicated.append(key)
    return sharded, replicated


def specs(model_config, world: int, layout: Layout, keys: dict[str, str]) -> dict:
    """{key: ms_reshard.ParamSpec} of the master-layout keys for `world` ranks under `layout`."""
    import ms_models

    shapes = {k: tuple(v) for k, v in ms_models.param_shapes(model_config).items()}
    owner = None
    if layout.pp > 1:
        microbatches = 4 * layout.pp  # any count the schedule takes: its stage-to-rank map is the same
        owner = owners(shapes, model_config.num_hidden_layers, build_schedule(layout.schedule, world, microbatches))
    by_name = layouts(model_config, world, layout.sharded, shapes, layout.tp, owner)
    return {key: by_name[name] for key, name in keys.items()}


class Layout(NamedTuple):
    """How a run kept its master weights (besides its number of ranks)."""

    sharded: bool
    """Optimizer sharding (ZeRO) over the DP replicas."""
    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    schedule: str
    """The pipeline schedule (which stage sits on which rank)."""


def run_layout(config) -> Layout:
    """The Layout of a TrainConfig."""
    return Layout(config.optimizer_shard, config.tp, config.pp, config.pipeline_schedule)


def saved_layout(path: str, state: dict, world: int) -> Layout:
    """The Layout of the run of `world` ranks that wrote the checkpoint (its `state`)."""
    saved = state.get("config")
    if not isinstance(saved, dict) or not isinstance(saved.get("optimizer_shard"), bool):
        raise CheckpointError(f"checkpoint {path!r}: state.json does not say whether its optimizer was sharded")
    sizes = {k: saved.get(k, 1) for k in ("tp", "pp")}  # written before TP/PP training existed: 1
    for key, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world % size:
            raise CheckpointError(f"checkpoint {path!r}: state.json holds {key}={size!r}, not a divisor of its ranks")
    schedule = saved.get("pipeline_schedule", "zbv")
    if not isinstance(schedule, str):
        raise CheckpointError(f"checkpoint {path!r}: state.json holds pipeline_schedule={schedule!r}")
    return Layout(saved["optimizer_shard"], sizes["tp"], sizes["pp"], schedule)


def load(path: str, manifest: dict, state: dict, model_config, rank: int, world: int, layout: Layout):
    """This rank's arrays (keys as ``GRPOTrainer.save_checkpoint`` writes them) from a checkpoint
    (its verified `manifest` and `state`) written under another layout; `world` and `layout` are
    this run's. Every file is verified first; a layout the files do not hold is a
    CheckpointError."""
    from safetensors import safe_open

    import ms_models
    from ms_reshard import ReshardError, model_plan, read_rank

    checkpoint.verify(path)  # every old rank's file: sizes and sha256
    old_world = manifest["world_size"]
    files = {r: os.path.join(path, checkpoint.rank_file(r)) for r in range(old_world)}
    names, stored = set(ms_models.param_shapes(model_config)), set()
    for r, file in files.items():  # a pipeline stage's rank holds only its own parameters
        try:
            with safe_open(file, framework="numpy") as f:
                stored.update(f.keys())
                if r == 0:
                    _, replicated = split_keys(list(f.keys()), names)
                    scalars = {k: f.get_tensor(k) for k in replicated}
        except Exception as exc:  # safetensors' own error types for a malformed header
            raise CheckpointError(f"checkpoint {path!r}: {checkpoint.rank_file(r)} is unreadable ({exc})") from None
    keys, _ = split_keys(sorted(stored), names)
    try:
        plan = model_plan(specs(model_config, old_world, saved_layout(path, state, old_world), keys),
                          specs(model_config, world, layout, keys))  # fmt: skip
        arrays = read_rank(plan, rank, files)
    except ReshardError as exc:
        raise CheckpointError(f"checkpoint {path!r} cannot be resharded to {world} ranks: {exc}") from None
    arrays.update({k: np.array(v, copy=True) for k, v in scalars.items()})
    return arrays
