"""DP attention + EP: every DP rank runs the same number of forwards in an engine step.

Each MoE layer's exchange needs every rank of the group, and a rank's step can be cut into more
compiled parts than another's (or be vLLM's `execute_dummy_batch`, no request at all). So the
ranks first agree on the step's forward count, an all-gather of one integer, and a rank with fewer
runs the missing ones after its own as forwards of no request: forward k of every rank then meets
forward k of the others, exchange by exchange.

Multi-step decoding adds rounds to a step: after its first forward a rank may run up to
multi_step - 1 further decode iterations, each a forward of its own, while another rank has a
prefill in its step and runs none (or stops early when its requests end). So the first agreement of
a step also carries how many extra rounds the rank plans, every rank runs the largest number of
rounds (each round its own agreement), and a rank whose requests ran out runs empty rounds: rounds
pair up like forwards do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np


class Lockstep:
    """The agreement of one rank (`group` None: a single engine, nothing to agree)."""

    def __init__(self, group, dummy_forward: Callable[[], None]):
        self.group, self.dummy_forward = group, dummy_forward
        self.rounds_owed = 0
        """extra rounds the ranks agreed on at this step's first forward, not run yet by this rank"""

    @contextlib.contextmanager
    def forwards(self, n: int, rounds: int = 0) -> Iterator[None]:
        """Around a step (or round) that runs `n` forwards: agree first, run the missing ones after.
        `rounds`: at a step's first agreement, the extra decode rounds this rank plans to run."""
        if self.group is None:
            yield
            return
        agreed = self.group.all_gather(np.array([n, rounds], np.int64)).reshape(-1, 2).max(0)
        self.rounds_owed = max(self.rounds_owed, int(agreed[1]))
        missing = int(agreed[0]) - n
        yield
        for _ in range(missing):
            self.dummy_forward()

    @contextlib.contextmanager
    def round(self) -> Iterator[None]:
        """Around one extra decode round (multi-step) whose forwards agree as a step's do."""
        if self.group is not None and self.rounds_owed < 1:
            raise RuntimeError("a multi-step round that the step's first agreement did not announce")
        yield
        self.rounds_owed = max(self.rounds_owed - 1, 0)

    def settle(self) -> None:
        """End of a step: the rounds other ranks run and this one does not, as empty rounds."""
        while self.rounds_owed > 0:
            with self.round(), self.forwards(0):
                pass


class OneByOne:
    """Pairs forwards whose number a rank learns only as it runs them (MTP drafting: the parts of the
    draft batch, the chained depths): before each forward every rank says whether it has one (an
    all-gather of a flag); a rank with none runs a forward of no request while any other has one,
    and the phase ends when no rank has one. `group` None: a single engine, nothing to pair."""

    def __init__(self, group, dummy_forward: Callable[[], None]):
        self.group, self.dummy_forward = group, dummy_forward

    def _any(self, flag: int) -> bool:
        return bool(self.group.all_gather(np.array([flag], np.int64)).max())

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around one forward of this rank's own."""
        if self.group is not None:
            self._any(1)
        yield

    def drain(self) -> None:
        """End of the phase: the other ranks' remaining forwards, each met by a forward of no request."""
        if self.group is None:
            return
        while self._any(0):
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


__all__ = ["Lockstep", "OneByOne", "padding_forward"]
