"""Rollout engines: the interface the trainer generates through, and the embedded engine.

An engine turns :class:`Request` s into :class:`Completion` s and exposes the Parameters that
weight sync writes into. Two implementations:

* :class:`EmbeddedEngine` (default): an ms_models model in this process.
  - ``mode="paged"``: ms_models' inference path, ``forward_paged`` over a paged KV cache (vLLM's
    flat-batch layout): all prompts of the batch prefilled in one call, then one decode token per
    running sequence per call. It runs in PyNative (the cache writes are in-place index
    assignments, which ``mindspore.jit`` would drop; docs/ms-models.md).
  - ``mode="jit"``: the training forward compiled with ``mindspore.jit`` over a fixed
    [batch, prompt + max_new_tokens] buffer, recomputing the whole (short) sequence each token.
    On CPU PyNative dispatch dominates a tiny model (measured 1.1 s per PyNative forward against
    7 ms compiled on a loaded 2-core machine), so this is what CPU runs use; for long sequences the
    paged path's O(1)-per-token decode wins.
* ``VllmEngine`` (runtime/vllm_engine.py): vLLM with the ms-vllm plugin.

Sampling is keyed, not stateful: request r of step s draws its uniforms from
``numpy.random.default_rng([seed, step, r])``. So a request's tokens do not depend on which
instance ran it, in which batch, or in which order (uniform vs contiguous sampling generate the
very same samples), and a resumed run needs no sampler state to continue bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..errors import RLHFError


@dataclass(frozen=True)
class Request:
    """One sample to generate."""

    request_id: int
    """r = prompt * n + sample (group order)."""
    prompt_ids: tuple[int, ...]
    """Prompt token ids (with <s>)."""
    key: tuple[int, ...]
    """Sampling key: the request's uniforms come from numpy.random.default_rng(key)."""
    max_new_tokens: int
    """Longest response."""
    stop_after: int | None = None
    """Benchmarks only: stop after exactly this many tokens (<= max_new_tokens), ignoring </s>."""

    def __post_init__(self) -> None:
        if self.stop_after is not None and not 1 <= self.stop_after <= self.max_new_tokens:
            raise RLHFError(f"request {self.request_id}: stop_after={self.stop_after} not in 1..{self.max_new_tokens}")


@dataclass
class Completion:
    """What came back for one request."""

    request_id: int
    """The request it answers."""
    tokens: list[int] = field(default_factory=list)
    """Response token ids (ending with </s> unless cut at max_new_tokens)."""
    logprobs: list[float] = field(default_factory=list)
    """Log-prob of each response token under the rollout model at temperature 1."""


class RolloutEngine(Protocol):
    """What the trainer needs from an inference engine."""

    def generate(self, requests: Sequence[Request], batch: int | None = None) -> list[Completion]:
        """Completions in request order; `batch`: the most sequences to run at once (an engine that
        schedules its own batches, as vLLM does, may ignore it)."""
        ...

    def weight_targets(self) -> dict[str, object]:
        """{HF parameter name: MindSpore Parameter} that weight sync writes the new policy into."""
        ...


def sample_token(logits: np.ndarray, temperature: float, uniform: float) -> tuple[int, float]:
    """Inverse-CDF sample from softmax(logits / T) with one uniform; returns (token, log-prob at T=1)."""
    z = logits.astype(np.float64)
    logp = z - z.max()
    logp -= np.log(np.exp(logp).sum())
    scaled = z / temperature
    p = np.exp(scaled - scaled.max())
    cdf = np.cumsum(p)
    token = int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))
    token = min(token, len(p) - 1)
    return token, float(logp[token])


class _Running:
    def __init__(self, request: Request):
        self.request = request
        self.tokens = list(request.prompt_ids)
        self.out = Completion(request.request_id)
        self.uniforms = np.random.default_rng(list(request.key)).random(request.max_new_tokens)
        self.blocks: list[int] = []
        self.computed = 0

    def push(self, logits: np.ndarray, temperature: float, eos_id: int) -> bool:
        """Sample the next token; True when the sequence is done."""
        stop = self.request.stop_after
        if stop is not None and len(self.out.tokens) + 1 < stop:
            logits = np.where(np.arange(len(logits)) == eos_id, -np.inf, logits)  # scripted length: no early </s>
        token, logp = sample_token(logits, temperature, self.uniforms[len(self.out.tokens)])
        self.out.tokens.append(token)
        self.out.logprobs.append(logp)
        self.tokens.append(token)
        n = len(self.out.tokens)
        if stop is not None:
            return n >= stop
        return token == eos_id or n >= self.request.max_new_tokens


class EmbeddedEngine:
    """An ms_models CausalLM generating in this process (see the module docstring)."""

    def __init__(self, model, eos_id: int, temperature: float = 1.0, mode: str = "paged", block_size: int = 8):
        if mode not in ("paged", "jit"):
            raise RLHFError(f"embedded engine mode {mode!r}; expected 'paged' or 'jit'")
        self.model, self.eos_id, self.temperature, self.mode, self.block_size = (
            model, eos_id, temperature, mode, block_size)  # fmt: skip
        self._compiled = None
        self.calls = 0  # forward calls so far: the engine's steps, a noise-free measure of its work

    def weight_targets(self) -> dict[str, object]:
        return dict(self.model.parameters_and_names())

    def generate(self, requests: Sequence[Request], batch: int | None = None) -> list[Completion]:
        """Completions in request order. At most `batch` sequences run at once (continuous
        batching: a finished sequence's place goes to the next waiting request, as vLLM's
        max_num_seqs); default: all of them. The jit path always computes `batch` rows (one
        compiled shape)."""
        if not requests:
            return []
        running = [_Running(r) for r in requests]
        slots = min(batch or len(running), len(running)) if self.mode == "paged" else (batch or len(running))
        if self.mode == "paged":
            self._paged(running, slots)
        else:
            self._jit(running, slots)
        return [r.out for r in running]

    # -------------------------------------------------------------------------- jit recompute
    def _jit(self, running: list[_Running], slots: int) -> None:
        import mindspore as ms

        if self._compiled is None:
            self._compiled = ms.jit(self.model)
        # prompt + max_new_tokens (not the scripted length): one compiled shape for every batch
        width = max(len(r.request.prompt_ids) + r.request.max_new_tokens for r in running)
        buf = np.zeros((slots, width), np.int32)
        waiting, seat = list(reversed(running)), [None] * slots
        while True:
            for i in range(slots):
                if seat[i] is None and waiting:  # admit the next request into a free row
                    seat[i] = waiting.pop()
                    buf[i] = 0
                    buf[i, : len(seat[i].tokens)] = seat[i].tokens
            if all(s is None for s in seat):
                return
            logits = self._compiled(ms.Tensor(buf)).asnumpy()
            self.calls += 1
            for i, seq in enumerate(seat):
                if seq is not None:
                    done = seq.push(logits[i, len(seq.tokens) - 1], self.temperature, self.eos_id)
                    buf[i, len(seq.tokens) - 1] = seq.tokens[-1]
                    seat[i] = None if done else seq

    # -------------------------------------------------------------------------- paged KV cache
    def _paged(self, running: list[_Running], slots: int) -> None:
        from ms_models import BlockAllocator

        bs = self.block_size
        per_seq = [-(-(len(r.tokens) + (r.request.stop_after or r.request.max_new_tokens)) // bs) for r in running]
        num_blocks = sum(sorted(per_seq)[-slots:])  # enough for the `slots` largest at once
        caches = self.model.allocate_kv_caches(num_blocks, bs)
        allocator = BlockAllocator(num_blocks)
        waiting, active = list(reversed(running)), []
        while waiting or active:
            while waiting and len(active) < slots:
                active.append(waiting.pop())
            ids, positions, slot_map, starts, lens = [], [], [], [0], []
            for seq in active:
                while len(seq.blocks) * bs < len(seq.tokens):
                    seq.blocks.append(allocator.allocate())
                for pos in range(seq.computed, len(seq.tokens)):
                    positions.append(pos)
                    slot_map.append(seq.blocks[pos // bs] * bs + pos % bs)
                ids += seq.tokens[seq.computed :]  # the whole prompt when admitted, then one token
                starts.append(len(ids))
                lens.append(len(seq.tokens))
            width = max(len(s.blocks) for s in active)
            tables = np.array([s.blocks + [0] * (width - len(s.blocks)) for s in active], np.int32)
            logits = self.model.forward_paged(
                np.array(ids, np.int32), np.array(positions, np.int32), caches, np.array(slot_map, np.int32), tables,
                np.array(lens, np.int32), np.array(starts, np.int32), logits_indices=np.array(starts[1:], np.int32) - 1,
            ).asnumpy()  # fmt: skip
            self.calls += 1
            still = []
            for seq, row in zip(active, logits):
                seq.computed = len(seq.tokens)
                if seq.push(row, self.temperature, self.eos_id):
                    allocator.release(seq.blocks)
                else:
                    still.append(seq)
            active = still
