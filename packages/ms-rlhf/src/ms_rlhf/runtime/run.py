"""A whole training run: resume, steps with a progress bar and a log line each, checkpoints, summary."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from .. import checkpoint
from ..config import TrainConfig
from ..errors import CheckpointError, RLHFError

log = logging.getLogger("ms_rlhf")

#: config keys (dotted, TrainConfig.dotted) a resumed run may change: `steps`, the checkpoint
#: settings and the `parallel` section (layouts: resharded on resume, like a new number of ranks);
#: anything else must match the checkpoint's config, nested or, from an earlier version, flat
RESUMABLE_CHANGES = {"steps", "checkpoint.dir", "checkpoint.every", "checkpoint.keep"}
RESUMABLE_CHANGES |= {"parallel.optimizer_shard", "parallel.tp", "parallel.pp", "parallel.pipeline_schedule"}


def _resume_path(config: TrainConfig, resume: str | None, group) -> tuple[str | None, list[dict[str, str]]]:
    """The checkpoint to resume from and the ones skipped on the way; rank 0 looks (verifying every
    file), the others follow its choice so all ranks load the same step."""
    if resume is None:
        return None, []
    if resume == "auto" and not config.checkpoint.dir:
        raise RLHFError("--resume auto needs checkpoint.dir in the config")
    where = config.checkpoint.dir if resume == "auto" else resume
    found, skipped, error = None, [], None
    if group.rank == 0:
        try:
            if resume != "auto" and os.path.isfile(os.path.join(where, "manifest.json")):
                found = where  # one checkpoint, named on purpose: load verifies it, no fallback
            else:
                found, skipped = checkpoint.newest_valid(where)  # None: nothing saved yet
                if found is None and resume != "auto":
                    raise CheckpointError(f"no checkpoint at {where!r} (no manifest.json, no step_NNNNNN folder)")
        except RLHFError as exc:
            error = exc
    if group.size > 1:
        found = _follow_rank0(group, where, found, error)
    if error is not None:
        raise error
    return found, skipped


def _follow_rank0(group, where: str, found: str | None, error: Exception | None) -> str | None:
    """Rank 0's choice (a step, none, or an error) on every rank."""
    import numpy as np

    if error is not None:
        code = -2
    elif found is None:
        code = -1
    else:
        code = checkpoint.read_manifest(found)["step"]
    choice = np.array([code], np.int64)
    group.broadcast(choice, src=0)
    if group.rank == 0:
        return found
    if choice[0] == -2:
        raise CheckpointError(f"rank 0 found no checkpoint to resume from under {where!r}")
    if choice[0] == -1:
        return None
    if os.path.isfile(os.path.join(where, "manifest.json")):
        return where
    return os.path.join(where, checkpoint.step_name(int(choice[0])))


def _check_same_run(config: TrainConfig, saved: TrainConfig) -> None:
    ours, theirs = config.dotted(), saved.dotted()
    changed = sorted(k for k in ours if k not in RESUMABLE_CHANGES and ours[k] != theirs[k])
    if changed:
        raise RLHFError(f"cannot resume: the config differs from the checkpoint's in {changed}")


def train(
    config: TrainConfig,
    group=None,
    resume: str | None = None,
    progress: bool = True,
    on_step: Callable[[dict], None] | None = None,
) -> dict:
    """Run `config.steps` steps (counting the resumed ones) and return a JSON-able summary."""
    from .group import world_group

    start = time.perf_counter()
    group = world_group(group)
    path, skipped = _resume_path(config, resume, group)  # before the (slow) imports and model build
    if path is not None:
        _check_same_run(config, _saved_config(path))
    from .trainer import GRPOTrainer

    trainer = GRPOTrainer(config, group)
    if path is not None:
        trainer.load_checkpoint(path)
        log.info("resumed from %s at step %d", path, trainer.step_count)
    first = trainer.rank == 0
    bar = None
    if progress and first:
        from tqdm import tqdm

        bar = tqdm(total=config.steps, initial=trainer.step_count, desc="GRPO", unit="step")
    saved = None
    while trainer.step_count < config.steps:
        m = trainer.step()
        if first:
            log.info(
                "step %d/%d reward %.3f acc %.3f loss %.4f kl %.4f tok/s %.0f rollout %.2fs train %.2fs sync %.3fs",
                m["step"], config.steps, m["reward"], m["accuracy"], m["loss"], _nan(m["kl"]), m["tokens_per_s"],
                m["rollout_makespan_s"], m["train_s"], m["sync_s"],
            )  # fmt: skip
        if bar is not None:
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward']:.3f}", loss=f"{m['loss']:.4f}", kl=f"{_nan(m['kl']):.4f}",
                            tok_s=f"{m['tokens_per_s']:.0f}")  # fmt: skip
        if on_step is not None:
            on_step(m)
        every = config.checkpoint.every
        if config.checkpoint.dir and every and trainer.step_count % every == 0:
            saved = trainer.save_checkpoint()
    if config.checkpoint.dir and (saved is None or not saved.endswith(f"{trainer.step_count:06d}")):
        saved = trainer.save_checkpoint()
    if bar is not None:
        bar.close()
    rewards = [h["reward"] for h in trainer.history]
    return {
        "steps": trainer.step_count,
        "resumed_from": path,
        "resume_skipped": skipped,
        "checkpoint": saved,
        "wall_s": time.perf_counter() - start,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "rewards": rewards,
        "losses": [h["loss"] for h in trainer.history],
        "last": trainer.history[-1] if trainer.history else None,
    }


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _saved_config(path: str) -> TrainConfig:
    """The config a checkpoint's run had: nested, or flat from an earlier version."""
    config = checkpoint.read_state(path).get("config")  # verified against the manifest first
    if not isinstance(config, dict):
        raise CheckpointError(f"checkpoint {path!r}: state.json has no config object")
    try:
        return TrainConfig.from_dict(config)
    except RLHFError as exc:
        raise CheckpointError(f"checkpoint {path!r}: its config does not read: {exc}") from None
