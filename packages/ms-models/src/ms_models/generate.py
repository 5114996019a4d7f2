"""Greedy generation over the paged cache, with a tiny continuous-batching scheduler.

This is the reference driver of `forward_paged` (the vLLM plugin is the production one): sequences
are admitted one per step, so one batch mixes a new prompt's prefill with the decode tokens of the
sequences already running, as vLLM's scheduler does. Blocks come from a free list that can be
shuffled, so block tables are not contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import ModelError


class BlockAllocator:
    """A free list of cache blocks; `shuffle` hands them out in a random (seeded) order."""

    def __init__(self, num_blocks: int, shuffle_seed: int | None = None):
        self.free = list(range(num_blocks))
        if shuffle_seed is not None:
            np.random.default_rng(shuffle_seed).shuffle(self.free)

    def allocate(self) -> int:
        """One free block; ModelError when the cache is full."""
        if not self.free:
            raise ModelError("paged KV cache is out of blocks; allocate more num_blocks")
        return self.free.pop(0)

    def release(self, blocks: list[int]) -> None:
        """Return blocks to the free list."""
        self.free.extend(blocks)


@dataclass
class _Sequence:
    tokens: list[int]
    prompt_len: int
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose keys/values are in the cache


def _ensure_blocks(seq: _Sequence, upto: int, block_size: int, allocator: BlockAllocator) -> None:
    while len(seq.blocks) * block_size < upto:
        seq.blocks.append(allocator.allocate())


def generate_greedy(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int = 4,
    num_blocks: int | None = None,
    shuffle_seed: int | None = 0,
    admit_per_step: int = 1,
) -> list[list[int]]:
    """Greedy continuations (max_new_tokens each) of `prompts`, computed through forward_paged."""
    if not prompts or any(len(p) == 0 for p in prompts) or max_new_tokens <= 0:
        raise ModelError("need non-empty prompts and max_new_tokens > 0")
    longest = max(len(p) for p in prompts) + max_new_tokens
    if num_blocks is None:
        num_blocks = len(prompts) * (-(-longest // block_size))
    caches = model.allocate_kv_caches(num_blocks, block_size)
    allocator = BlockAllocator(num_blocks, shuffle_seed)
    waiting = [_Sequence(list(p), len(p)) for p in prompts]
    order = list(waiting)
    running: list[_Sequence] = []
    while waiting or running:
        running += [waiting.pop(0) for _ in range(min(admit_per_step, len(waiting)))]
        ids, positions, slots, starts, lens = [], [], [], [0], []
        for seq in running:
            new = seq.tokens[seq.computed :]  # the whole prompt at first, then one token
            _ensure_blocks(seq, len(seq.tokens), block_size, allocator)
            for pos in range(seq.computed, len(seq.tokens)):
                positions.append(pos)
                slots.append(seq.blocks[pos // block_size] * block_size + pos % block_size)
            ids += new
            starts.append(len(ids))
            lens.append(len(seq.tokens))
        width = max(len(s.blocks) for s in running)
        tables = np.array([s.blocks + [0] * (width - len(s.blocks)) for s in running], np.int32)
        last_rows = np.array(starts[1:], np.int32) - 1
        logits = model.forward_paged(
            np.array(ids, np.int32),
            np.array(positions, np.int32),
            caches,
            np.array(slots, np.int32),
            tables,
            np.array(lens, np.int32),
            np.array(starts, np.int32),
            logits_indices=last_rows,
        ).asnumpy()
        for seq, row in zip(list(running), logits):
            seq.computed = len(seq.tokens)
            seq.tokens.append(int(row.argmax()))
            if len(seq.tokens) - seq.prompt_len == max_new_tokens:
                allocator.release(seq.blocks)
                running.remove(seq)
    return [s.tokens[s.prompt_len :] for s in order]


def generate_greedy_recompute(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference: run the full training-path forward over the whole sequence at every step."""
    from mindspore import Tensor

    tokens = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(Tensor(np.array([tokens], np.int32))).asnumpy()
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]
