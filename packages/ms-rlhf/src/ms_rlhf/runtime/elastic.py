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

import contextlib
import os
from typing import NamedTuple

import numpy as np

from .. import checkpoint
from ..config import dotted_keys
from ..errors import CheckpointError, RLHFError
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


def specs(model_config, world: int, layout: MasterLayout, keys: dict[str, str]) -> dict:
    """{key: ms_reshard.ParamSpec} of the master-layout keys for `world` ranks under `layout`."""
    import ms_models

    shapes = {k: tuple(v) for k, v in ms_models.param_shapes(model_config).items()}
    owner = None
    if layout.pp > 1:
        microbatches = 4 * layout.pp  # any count the schedule takes: its stage-to-rank map is the same
        owner = owners(shapes, model_config.num_hidden_layers, build_schedule(layout.schedule, world, microbatches))
    by_name = layouts(model_config, world, layout.sharded, shapes, layout.tp, owner)
    return {key: by_name[name] for key, name in keys.items()}


class MasterLayout(NamedTuple):
    """How a run kept its master weights (besides its number of ranks): its config's `parallel`
    section. Not an ms_layout.Layout, one tensor's placement, which the specs below are made of."""

    sharded: bool
    """Optimizer sharding (ZeRO) over the DP replicas."""
    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    schedule: str
    """The pipeline schedule (which stage sits on which rank)."""


def run_layout(config) -> MasterLayout:
    """The MasterLayout of a TrainConfig."""
    par = config.parallel
    return MasterLayout(par.optimizer_shard, par.tp, par.pp, par.pipeline_schedule)


def saved_layout(path: str, state: dict, world: int) -> MasterLayout:
    """The MasterLayout of the run of `world` ranks that wrote the checkpoint (its `state`), whose
    config is nested or, written by an earlier version, flat (config_keys.py)."""
    try:
        saved = dotted_keys(state.get("config"))
    except RLHFError as exc:
        raise CheckpointError(f"checkpoint {path!r}: state.json holds no readable config ({exc})") from None
    if not isinstance(saved.get("parallel.optimizer_shard"), bool):
        raise CheckpointError(f"checkpoint {path!r}: state.json does not say whether its optimizer was sharded")
    sizes = {k: saved.get(f"parallel.{k}", 1) for k in ("tp", "pp")}  # written before TP/PP training existed: 1
    for key, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world % size:
            raise CheckpointError(
                f"checkpoint {path!r}: state.json holds parallel.{key}={size!r}, not a divisor of its ranks"
            )
    schedule = saved.get("parallel.pipeline_schedule", "zbv")
    if not isinstance(schedule, str):
        raise CheckpointError(f"checkpoint {path!r}: state.json holds parallel.pipeline_schedule={schedule!r}")
    return MasterLayout(saved["parallel.optimizer_shard"], sizes["tp"], sizes["pp"], schedule)


def load(path: str, manifest: dict, state: dict, model_config, rank: int, world: int, layout: MasterLayout):
    """This rank's arrays (keys as ``GRPOTrainer.save_checkpoint`` writes them) from a checkpoint
    (its verified `manifest` and `state`) written under another layout; `world` and `layout` are
    this run's. Every file is verified first; a layout the files do not hold is a
    CheckpointError."""
    import ms_models
    from ms_reshard import ReshardError, model_plan, read_rank

    checkpoint.verify(path, manifest=manifest)  # every old rank's file: sizes and sha256
    old_world = manifest["world_size"]
    files = {r: os.path.join(path, checkpoint.rank_file(r)) for r in range(old_world)}
    names = set(ms_models.param_shapes(model_config))
    with _open(path, 0, files[0]) as f:  # the replicated scalars are the same in every file: read the first's
        stored = set(f.keys())
        _, replicated = split_keys(sorted(stored), names)
        scalars = {k: f.get_tensor(k) for k in replicated}
    for r in range(1, old_world):  # a pipeline stage's rank holds only its own parameters
        with _open(path, r, files[r]) as f:
            stored.update(f.keys())
    keys, _ = split_keys(sorted(stored), names)
    try:
        plan = model_plan(specs(model_config, old_world, saved_layout(path, state, old_world), keys),
                          specs(model_config, world, layout, keys))  # fmt: skip
        arrays = read_rank(plan, rank, files)
    except ReshardError as exc:
        raise CheckpointError(f"checkpoint {path!r} cannot be resharded to {world} ranks: {exc}") from None
    arrays.update({k: np.array(v, copy=True) for k, v in scalars.items()})
    return arrays


@contextlib.contextmanager
def _open(path: str, rank: int, file: str):
    """An old rank file as a lazy safetensors reader; a malformed one (its header, a tensor read in
    the block) is a CheckpointError naming it."""
    from safetensors import safe_open

    try:
        with safe_open(file, framework="numpy") as f:
            yield f
    except Exception as exc:  # safetensors' own error types
        raise CheckpointError(f"checkpoint {path!r}: {checkpoint.rank_file(rank)} is unreadable ({exc})") from None
