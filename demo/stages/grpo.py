"""Stage 5: GRPO with uniform sampling and dynamic packing (ms-rlhf), interrupted and resumed.

ms-rlhf's trainer runs its shipped verifiable task ("add": the policy learns to answer a + b)
with rollouts spread uniformly over its DP inference instances (``rollout.strategy="uniform"``)
and samples packed into as few rows as fit (``packing.enabled=True``). Three runs of the same config:

1. uninterrupted, ``steps`` steps;
2. interrupted: the same config stopped after ``stop_after`` steps, leaving its checkpoint (as a
   job killed at that point would, since a checkpoint is written atomically per step);
3. resumed from that checkpoint, by a fresh trainer, to ``steps``.

The resumed steps' losses and rewards must equal the uninterrupted run's, bit for bit.

The policy is ms-rlhf's own tiny Llama over its character tokenizer, not the pretrained
DeepSeek-V3: the task's vocabulary is ms-rlhf's ``CharTokenizer``, which the BPE-tokenised
pretraining text does not share, and ms-rlhf's ``model_path`` option needs the checkpoint's
vocabulary to cover the task's ids with the same meaning.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from common import StageResult, setup_mindspore, timed


@dataclass(frozen=True)
class GrpoConfig:
    """How long GRPO runs, where it stops and resumes."""

    steps: int = 4
    """GRPO steps of the whole run."""
    stop_after: int = 2
    """Where the interrupted run stops."""
    prompts_per_step: int = 8
    """Prompts per step."""
    samples_per_prompt: int = 8
    """Samples per prompt (the GRPO group)."""
    rollout_instances: int = 2
    """DP inference instances the samples spread over (uniformly)."""
    jit: bool = True
    """Compile the trainer's model with mindspore.jit (slower first step, faster after)."""


def _train_config(config: GrpoConfig, checkpoint_dir: Path | None):
    import ms_rlhf

    return ms_rlhf.TrainConfig(
        steps=config.steps,
        jit=config.jit,
        rollout=ms_rlhf.RolloutConfig(
            prompts_per_step=config.prompts_per_step,
            samples_per_prompt=config.samples_per_prompt,
            instances=config.rollout_instances,
            strategy="uniform",
        ),
        packing=ms_rlhf.PackingConfig(enabled=True),
        checkpoint=ms_rlhf.CheckpointConfig(
            dir=str(checkpoint_dir) if checkpoint_dir else None, every=1 if checkpoint_dir else 0
        ),
    )


def run(config: GrpoConfig, work: Path) -> StageResult:
    import ms_rlhf

    result = StageResult("grpo")
    with timed(result):
        setup_mindspore(1)
        ckpt = work / "grpo_ckpt"
        if ckpt.exists():
            shutil.rmtree(ckpt)
        full = ms_rlhf.train(_train_config(config, None), progress=True)
        stopped = ms_rlhf.train(replace(_train_config(config, ckpt), steps=config.stop_after), progress=True)
        resumed = ms_rlhf.train(_train_config(config, ckpt), resume="auto", progress=True)

        k = config.stop_after
        tail = slice(len(resumed["losses"]) - (config.steps - k), None)
        result.check(
            "interrupted run stopped with a checkpoint", stopped["steps"] == k and bool(stopped["checkpoint"]),
            f"stopped at step {stopped['steps']}, checkpoint {Path(stopped['checkpoint'] or '').name}",
        )  # fmt: skip
        result.check(
            "resumed from it",
            bool(resumed["resumed_from"]) and resumed["steps"] == config.steps,
            f"resumed from {Path(resumed['resumed_from'] or '').name} to step {resumed['steps']}",
        )
        result.check(
            "resumed losses == uninterrupted losses (bit for bit), and they are not all zero",
            resumed["losses"][tail] == full["losses"][k:]
            and resumed["rewards"][tail] == full["rewards"][k:]
            and any(x != 0 for x in full["losses"][k:]),
            f"steps {k + 1}-{config.steps}: {[f'{x:.6g}' for x in full['losses'][k:]]}",
        )
        last = full["last"] or {}
        result.check(
            "dynamic packing reaches its lower bound (last step)",
            last.get("packs") is not None and last.get("packs") == last.get("pack_lower_bound"),
            f"{last.get('packs')} packs, lower bound {last.get('pack_lower_bound')}",
        )
        result.numbers = {
            "losses": full["losses"],
            "rewards": full["rewards"],
            "resumed_losses": resumed["losses"][tail],
            "packs_last_step": last.get("packs"),
            "pack_lower_bound_last_step": last.get("pack_lower_bound"),
            "pad_tokens_last_step": last.get("pad_tokens"),
            "row_tokens_last_step": last.get("row_tokens"),
            "infer_train_logprob_maxdiff": last.get("infer_train_logprob_maxdiff"),
            "uninterrupted_s": full["wall_s"],
        }
    return result
