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

import numpy as np

from .. import checkpoint
from ..errors import CheckpointError
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


def specs(model_config, world: int, sharded: bool, tp: int, keys: dict[str, str]) -> dict:
    """{key: ms_reshard.ParamSpec} of the master-layout keys for `world` ranks."""
    import ms_models

    shapes = {k: tuple(v) for k, v in ms_models.param_shapes(model_config).items()}
    by_name = layouts(model_config, world, sharded, shapes, tp)
    return {key: by_name[name] for key, name in keys.items()}


def saved_layout(path: str, state: dict, world: int) -> tuple[bool, int]:
    """(optimizer sharding, tp) of the run of `world` ranks that wrote the checkpoint (its `state`)."""
    saved = state.get("config")
    if not isinstance(saved, dict) or not isinstance(saved.get("optimizer_shard"), bool):
        raise CheckpointError(f"checkpoint {path!r}: state.json does not say whether its optimizer was sharded")
    tp = saved.get("tp", 1)  # written before tensor parallel training existed: 1
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world % tp:
        raise CheckpointError(f"checkpoint {path!r}: state.json holds tp={tp!r}, not a divisor of its ranks")
    return saved["optimizer_shard"], tp


def load(path: str, manifest: dict, state: dict, model_config, rank: int, world: int, sharded: bool, tp: int):
    """This rank's arrays (keys as ``GRPOTrainer.save_checkpoint`` writes them) from a checkpoint
    (its verified `manifest` and `state`) written under another layout; `world`, `sharded` and `tp`
    are this run's. Every file is verified first; a layout the files do not hold is a
    CheckpointError."""
    from safetensors import safe_open

    import ms_models
    from ms_reshard import ReshardError, model_plan, read_rank

    checkpoint.verify(path)  # every old rank's file: sizes and sha256
    old_world = manifest["world_size"]
    files = {r: os.path.join(path, checkpoint.rank_file(r)) for r in range(old_world)}
    try:
        with safe_open(files[0], framework="numpy") as first:
            keys, replicated = split_keys(list(first.keys()), set(ms_models.param_shapes(model_config)))
            scalars = {k: first.get_tensor(k) for k in replicated}
    except Exception as exc:  # safetensors' own error types for a malformed header
        raise CheckpointError(f"checkpoint {path!r}: {checkpoint.rank_file(0)} is unreadable ({exc})") from None
    try:
        plan = model_plan(specs(model_config, old_world, *saved_layout(path, state, old_world), keys),
                          specs(model_config, world, sharded, tp, keys))  # fmt: skip
        arrays = read_rank(plan, rank, files)
    except ReshardError as exc:
        raise CheckpointError(f"checkpoint {path!r} cannot be resharded to {world} ranks: {exc}") from None
    arrays.update({k: np.array(v, copy=True) for k, v in scalars.items()})
    return arrays
