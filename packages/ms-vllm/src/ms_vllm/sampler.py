"""Token sampling in numpy with vLLM's SamplingParams semantics.

The model returns float32 logits for the rows that need a token; everything after that is host
work on [rows, vocab] arrays, so numpy is the simplest correct tool (vLLM's own sampler is torch on
the device for the same reason: it sits next to the logits). The order of the steps is vLLM's
(vllm/v1/sample/sampler.py): penalties and min-tokens masking on the raw logits, then
temperature, min-p, top-k and top-p, then greedy argmax or a draw from the request's generator
(seeded with `SamplingParams.seed`, so a seeded request draws the same tokens every run).
Logprobs are taken from the raw logits (vLLM's default `logprobs_mode="raw_logprobs"`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_EPS = 1e-5
"""vLLM treats temperature below this as greedy."""


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of logits."""

    params: object
    """The request's vllm.SamplingParams (duck-typed: temperature, top_k, top_p, ...)."""
    generator: np.random.Generator | None
    """The request's own generator (seeded requests), or None for the shared one."""
    prompt_ids: list[int]
    """Prompt tokens (repetition penalty looks at them)."""
    output_ids: list[int]
    """Tokens generated so far, including any accepted earlier in this step."""


def is_greedy(params) -> bool:
    return params.temperature < _EPS


def _apply_penalties(logits: np.ndarray, row: SamplingRow) -> None:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(row.prompt_ids + row.output_ids, np.int64))
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
        ids, counts = np.unique(np.asarray(row.output_ids, np.int64), return_counts=True)
        logits[ids] -= p.frequency_penalty * counts + p.presence_penalty
    if getattr(p, "logit_bias", None):
        for token, bias in p.logit_bias.items():
            logits[int(token)] += bias
    if getattr(p, "allowed_token_ids", None):
        mask = np.full_like(logits, -np.inf)
        mask[np.asarray(p.allowed_token_ids, np.int64)] = 0.0
        logits += mask
    if p.min_tokens and len(row.output_ids) < p.min_tokens:
        stops = [t for t in p.all_stop_token_ids if t < logits.shape[0]]
        logits[stops] = -np.inf


def _filter(probs: np.ndarray, p) -> np.ndarray:
    """min-p, top-k, top-p on one row of probabilities (renormalised)."""
    if p.min_p > 0:
        probs = np.where(probs < p.min_p * probs.max(), 0.0, probs)
    if 0 < p.top_k < probs.shape[0]:
        kth = np.partition(probs, -p.top_k)[-p.top_k]
        probs = np.where(probs < kth, 0.0, probs)
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order] / probs.sum()
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        cut = np.cumsum(sorted_probs) - sorted_probs >= p.top_p
        probs = probs.copy()
        probs[order[cut]] = 0.0
    return probs / probs.sum()


def sample_row(logits: np.ndarray, row: SamplingRow, shared: np.random.Generator) -> int:
    """One token from one row of raw float logits."""
    logits = np.array(logits, np.float64)
    _apply_penalties(logits, row)
    p = row.params
    if is_greedy(p):
        return int(np.argmax(logits))
    logits = logits / p.temperature
    logits -= logits.max()
    probs = _filter(np.exp(logits), p)
    rng = row.generator if row.generator is not None else shared
    return int(rng.choice(probs.shape[0], p=probs))


def logprobs_of(logits: np.ndarray, sampled: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vLLM's LogprobsLists fields for rows of raw logits: ids [R, k+1] (sampled token first, then
    the top k), logprobs [R, k+1], and the rank of each sampled token (1 = most likely)."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    rows = np.arange(len(sampled))
    chosen = logp[rows, sampled]
    ranks = (logp > chosen[:, None]).sum(-1) + 1
    top = np.argsort(-logp, -1, kind="stable")[:, :k]
    ids = np.concatenate([sampled[:, None], top], 1).astype(np.int32)
    vals = np.take_along_axis(logp, ids.astype(np.int64), 1).astype(np.float32)
    return ids, vals, ranks.astype(np.int32)


def logprobs_lists(wanted: list, sampled: list[list[int]], rows: list[np.ndarray]):
    """vLLM's LogprobsLists for a step (`wanted`: each request's `logprobs` setting, None for none;
    `rows`: each request's logits rows of its emitted tokens), or None when no request asks."""
    wanted = [w for w in wanted if w is not None]
    flat = [t for toks in sampled for t in toks]
    if not wanted or not flat:
        return None
    from vllm.v1.outputs import LogprobsLists

    k = max(wanted)
    if k < 0:  # -1: the whole vocabulary
        k = rows[0].shape[-1]
    ids, vals, ranks = logprobs_of(np.concatenate(rows), np.asarray(flat, np.int64), k)
    cu = np.concatenate([[0], np.cumsum([len(t) for t in sampled])]).astype(int).tolist()
    return LogprobsLists(ids, vals, ranks, cu)
