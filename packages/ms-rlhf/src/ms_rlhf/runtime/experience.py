"""From a rollout to training rows: rewards, advantages, packs (or padded batches) per DP rank.

Pure numpy on top of the core; every rank computes the same thing from the same gathered
completions, then keeps its own rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..balance import partition
from ..loss import Row, build_row, group_advantages, sample_weights
from ..packing import padded_batches, plan_packs


@dataclass
class Experience:
    """One rollout, in group order."""

    sequences: list[np.ndarray]
    """prompt + response token ids per sample."""
    prompt_lens: np.ndarray
    """Prompt length per sample."""
    rewards: np.ndarray
    """Reward per sample."""
    advantages: np.ndarray
    """Group-normalised advantage per sample."""
    rollout_logprobs: list[np.ndarray]
    """The rollout engine's log-prob of each response token."""

    @property
    def response_lens(self) -> np.ndarray:
        """Response tokens per sample."""
        return np.array([len(s) for s in self.sequences]) - self.prompt_lens


def make_experience(prompts: Sequence[Sequence[int]], completions, rewards, n: int) -> Experience:
    """Samples in request order from prompts (one per request) and completions."""
    sequences = [np.array([*p, *c.tokens], np.int64) for p, c in zip(prompts, completions)]
    return Experience(
        sequences=sequences,
        prompt_lens=np.array([len(p) for p in prompts]),
        rewards=np.asarray(rewards, np.float64),
        advantages=group_advantages(rewards, n),
        rollout_logprobs=[np.asarray(c.logprobs, np.float32) for c in completions],
    )


@dataclass
class MicroBatch:
    """Rows trained together in one forward/backward."""

    rows: list[Row]
    """Equal-width rows."""
    samples: list[int]
    """Samples in these rows."""


def micro_batches(
    exp: Experience,
    samples: Sequence[int],
    rank: int,
    world: int,
    packing: bool,
    max_pack_len: int,
    max_pack_count: int | None,
    rows_per_micro_batch: int,
    fixed_width: int | None,
) -> tuple[list[MicroBatch], dict]:
    """This rank's micro-batches for a mini-batch of `samples`, and packing statistics.

    Packing: the packs are spread over the ranks by a balanced partition of their token counts
    (equal pack counts), then each rank's packs go `rows_per_micro_batch` to a micro-batch.
    Padding (the baseline): consecutive samples, `rows_per_micro_batch` per micro-batch, one per
    row. `fixed_width` pads every row to one width and every micro-batch to the full row count,
    so that mindspore.jit compiles a single graph."""
    samples = list(samples)
    lengths = [len(exp.sequences[s]) for s in samples]
    per = rows_per_micro_batch
    if packing:
        plan = plan_packs(lengths, max_pack_len, max_pack_count)
        packs = [[samples[i] for i in p] for p in plan.packs]
        costs = [sum(lengths[i] for i in p) for p in plan.packs]
        mine = [packs[i] for i in _share(costs, rank, world)]
        chunks = [mine[i : i + per] for i in range(0, len(mine), per)]
        stats = {"packs": plan.num_packs, "pack_lower_bound": plan.lower_bound}
    else:
        batches = [[samples[i] for i in b] for b in padded_batches(len(samples), per)]
        costs = [per * max(len(exp.sequences[s]) for s in b) for b in batches]
        chunks = [[[s] for s in batches[i]] for i in _share(costs, rank, world)]
        stats = {"packs": 0, "pack_lower_bound": 0}
    out, slots, padded = [], 0, 0
    for rows in chunks:
        if fixed_width:
            rows = rows + [[]] * (per - len(rows))
        width = fixed_width or max(sum(len(exp.sequences[s]) for s in row) for row in rows)
        built = [build_row(row, exp.sequences, exp.prompt_lens, width) for row in rows]
        slots += width * len(rows)
        padded += width * len(rows) - sum(r.num_tokens for r in built)
        out.append(MicroBatch(built, [s for row in rows for s in row]))
    stats.update({"row_tokens": slots, "pad_tokens": padded})
    return out, stats


def _share(costs: Sequence[float], rank: int, world: int) -> list[int]:
    """This rank's items of a balanced partition with equal counts (all of them on one rank)."""
    return partition(costs, world, equal_size=True)[rank] if world > 1 else list(range(len(costs)))


def weights_for(exp: Experience, samples: Sequence[int], aggregation: str) -> np.ndarray:
    """Per-sample token weight over all samples (0 outside the mini-batch), from the mini-batch's
    whole-step counts: the same on every rank whatever rows it holds."""
    out = np.zeros(len(exp.sequences), np.float64)
    out[list(samples)] = sample_weights(exp.response_lens[list(samples)], aggregation)
    return out
