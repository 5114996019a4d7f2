"""DP attention + EP: every DP rank runs the same number of forwards in an engine step.

Each MoE layer's exchange needs every rank of the group, and a rank's step can be cut into more
compiled parts than another's (or be vLLM's `execute_dummy_batch`, no request at all). So the
ranks first agree on the step's forward count, an all-gather of one integer, and a rank with fewer
runs the missing ones after its own as forwards of no request: forward k of every rank then meets
forward k of the others, exchange by exchange.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np


class Lockstep:
    """The agreement of one rank (`group` None: a single engine, nothing to agree)."""

    def __init__(self, group, dummy_forward: Callable[[], None]):
        self.group, self.dummy_forward = group, dummy_forward

    @contextlib.contextmanager
    def forwards(self, n: int) -> Iterator[None]:
        """Around a step that runs `n` forwards: agree first, run the missing ones after."""
        if self.group is None:
            yield
            return
        missing = int(self.group.all_gather(np.array([n], np.int64)).max()) - n
        yield
        for _ in range(missing):
            self.dummy_forward()


def padding_forward(model, kv_caches, scratch_block: int, block_size: int) -> None:
    """An eager forward of one padding token written to the scratch block (no request owns it)."""
    from mindspore import Tensor

    zero = np.zeros(1, np.int32)
    slot = np.array([scratch_block * block_size], np.int32)
    model.forward_paged(
        Tensor(zero), Tensor(zero), kv_caches, slot, np.array([[scratch_block]], np.int32),
        np.ones(1, np.int32), np.array([0, 1], np.int32), logits_indices=zero, block_size=block_size,
    ).asnumpy()  # fmt: skip


__all__ = ["Lockstep", "padding_forward"]
