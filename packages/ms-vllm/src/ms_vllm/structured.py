"""Structured outputs (JSON schema, regex, choice, grammar) through vLLM's own path.

vLLM's scheduler owns the grammars (xgrammar or another backend): while the worker runs the model
it computes, per structured-output request, a bitmask of the tokens the grammar allows next
(`GrammarOutput`: int32 words, bit i % 32 of word i // 32 set = token i allowed; one row per
sampled position, `1 + drafts` rows a request, the same stride for every request). The runner
returns None from `execute_model` for such a step, vLLM calls `sample_tokens(grammar_output)`, and
the masked-out logits are set to -inf before the usual sampler runs, so greedy, temperature, top-k/p
and penalties all act inside the grammar. Drafts past `num_acceptable_drafts` were not constrained
by the grammar and are never accepted.
"""

from __future__ import annotations

import numpy as np

from .batch import StepBatch


def allowed_tokens(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """[rows, words] int32 bitmask -> [rows, vocab] bool (little-endian bit order within each word)."""
    words = np.ascontiguousarray(np.asarray(bitmask).astype("<i4")).view(np.uint8)
    return np.unpackbits(words, axis=-1, bitorder="little")[:, :vocab].astype(bool)


def apply_grammar_bitmask(logits: np.ndarray, batch: StepBatch, grammar_output) -> dict[str, int]:
    """Set the logits the grammar forbids to -inf, in place; returns per structured request how many
    of its drafts may be accepted."""
    ids = list(grammar_output.structured_output_request_ids)
    if not ids:
        return {}
    bitmask = np.asarray(grammar_output.grammar_bitmask)
    stride = bitmask.shape[0] // len(ids)
    first_row, cursor = {}, 0
    for req_id, rows in zip(batch.req_ids, batch.sample_rows):
        first_row[req_id] = (cursor, len(rows))
        cursor += len(rows)
    acceptable = grammar_output.num_acceptable_drafts
    limits = {}
    for k, req_id in enumerate(ids):
        if req_id not in first_row:  # not sampled in this step (a prefill chunk)
            continue
        start, n = first_row[req_id]
        n = min(n, stride)
        allowed = allowed_tokens(bitmask[k * stride : k * stride + n], logits.shape[-1])
        logits[start : start + n][~allowed] = -np.inf
        limits[req_id] = 0 if acceptable is None else int(acceptable[k])
    return limits


__all__ = ["allowed_tokens", "apply_grammar_bitmask"]
