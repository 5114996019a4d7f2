"""A whole training run: resume, steps with a progress bar and a log line each, checkpoints, summary."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from .. import checkpoint
from ..config import TrainConfig
from ..errors import RLHFError

log = logging.getLogger("ms_rlhf")

#: config keys a resumed run may change; anything else must match the checkpoint's config
RESUMABLE_CHANGES = {"steps", "checkpoint_dir", "checkpoint_every", "keep_checkpoints"}


def _resume_path(config: TrainConfig, resume: str | None) -> str | None:
    if resume is None:
        return None
    if resume == "auto":
        if not config.checkpoint_dir:
            raise RLHFError("--resume auto needs checkpoint_dir in the config")
        return checkpoint.latest(config.checkpoint_dir)  # None: nothing saved yet, start fresh
    return checkpoint.resolve(resume)


def _check_same_run(config: TrainConfig, saved: dict) -> None:
    ours = config.to_dict()
    changed = sorted(k for k in ours if k not in RESUMABLE_CHANGES and ours[k] != saved.get(k))
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
    from .trainer import GRPOTrainer

    start = time.perf_counter()
    trainer = GRPOTrainer(config, group)
    path = _resume_path(config, resume)
    if path is not None:
        checkpoint.read_manifest(path)
        _check_same_run(config, _saved_config(path))
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
                m["step"], config.steps, m["reward"], m["accuracy"], m["loss"], m["kl"], m["tokens_per_s"],
                m["rollout_makespan_s"], m["train_s"], m["sync_s"],
            )  # fmt: skip
        if bar is not None:
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward']:.3f}", loss=f"{m['loss']:.4f}", kl=f"{m['kl']:.4f}",
                            tok_s=f"{m['tokens_per_s']:.0f}")  # fmt: skip
        if on_step is not None:
            on_step(m)
        every = config.checkpoint_every
        if config.checkpoint_dir and every and trainer.step_count % every == 0:
            saved = trainer.save_checkpoint()
    if config.checkpoint_dir and (saved is None or not saved.endswith(f"{trainer.step_count:06d}")):
        saved = trainer.save_checkpoint()
    if bar is not None:
        bar.close()
    rewards = [h["reward"] for h in trainer.history]
    return {
        "steps": trainer.step_count,
        "resumed_from": path,
        "checkpoint": saved,
        "wall_s": time.perf_counter() - start,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "rewards": rewards,
        "losses": [h["loss"] for h in trainer.history],
        "last": trainer.history[-1] if trainer.history else None,
    }


def _saved_config(path: str) -> dict:
    import json

    with open(os.path.join(path, "state.json")) as f:
        return json.load(f)["config"]
