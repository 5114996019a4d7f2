"""The GRPO loss over packed batches, and why it equals the unpacked loss whatever the split.

GRPO (DeepSeekMath, Shao et al. 2024) with "seq-mean-token-mean" aggregation is

    L = 1/S * sum_s 1/|s| * sum_{t in s} l_t,   l_t = pg_t + beta * kl_t
    pg_t = -min(r_t A_s, clip(r_t, 1 - eps, 1 + eps) A_s),   r_t = exp(logp_t - old_t)
    kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1      (Schulman's k3 estimator)

over S samples s, each with |s| response tokens. L is linear in the per-token terms, so giving
every token the weight w_t = 1 / (|s| * S) -- |s| and S counted over the *whole* step, before
any split -- makes L = sum_t w_t l_t, a plain sum. A sum splits over any packs, micro-batches and
DP ranks: each micro-batch contributes sum_{t in mb} w_t l_t, gradients are accumulated by
addition and reduced over DP ranks by SUM (a DP mean must be multiplied back by dp). Computing a
mean per micro-batch instead (token means over a pack mix samples, so short samples lose weight)
is the bug behind OpenRLHF PR #923 and verl #5625 (docs/rlhf-reshard-prior-art.md §6);
tests/test_loss_algebra.py shows both the exact equality and the size of that error.

Other aggregations are the same with other weights: "token-mean" w_t = 1/T (T loss tokens in
the step), "seq-mean-token-sum" w_t = 1/S.

Token alignment in a row: logits at position t predict token t + 1, so a sample occupying
[a, b) of a row with prompt length P has its response log-probs at logit positions
a + P - 1 .. b - 2; no position predicts across a sample boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import RLHFError

AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")


def sample_weights(response_lengths: Sequence[int], aggregation: str = "seq-mean-token-mean") -> np.ndarray:
    """Per sample, the weight each of its response tokens gets (float64), from whole-step counts."""
    lens = np.asarray(response_lengths, dtype=np.int64)
    if lens.ndim != 1 or lens.size == 0:
        raise RLHFError(f"response_lengths must be a non-empty 1-d sequence, got shape {lens.shape}")
    for i in np.flatnonzero(lens < 1):
        raise RLHFError(f"sample {int(i)} has {int(lens[i])} response tokens; every sample needs at least one")
    if aggregation == "seq-mean-token-mean":
        return 1.0 / (lens.astype(np.float64) * lens.size)
    if aggregation == "token-mean":
        return np.full(lens.size, 1.0 / float(lens.sum()))
    if aggregation == "seq-mean-token-sum":
        return np.full(lens.size, 1.0 / lens.size)
    raise RLHFError(f"unknown loss aggregation {aggregation!r}; expected one of {AGGREGATIONS}")


def group_advantages(rewards: Sequence[float], n: int, eps: float = 1e-6, scale: bool = True) -> np.ndarray:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std (+ eps)
    when `scale`; rewards are in group order (n consecutive samples per prompt)."""
    r = np.asarray(rewards, dtype=np.float64)
    if n < 1 or r.size % n:
        raise RLHFError(f"{r.size} rewards do not split into groups of n={n}")
    g = r.reshape(-1, n)
    adv = g - g.mean(axis=1, keepdims=True)
    if scale:
        adv = adv / (g.std(axis=1, keepdims=True) + eps)
    return adv.reshape(-1)


def token_terms(logp, old_logp, ref_logp, adv, clip_eps: float, kl_coef: float) -> dict[str, np.ndarray]:
    """Per-token GRPO terms in float64: loss, pg, kl, clipped (bool), ratio, and d loss / d logp."""
    logp, old, ref, adv = (np.asarray(x, dtype=np.float64) for x in (logp, old_logp, ref_logp, adv))
    ratio = np.exp(logp - old)
    unclipped, clipped = ratio * adv, np.clip(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    pg = -np.minimum(unclipped, clipped)
    diff = ref - logp
    kl = np.exp(diff) - diff - 1
    use_unclipped = unclipped <= clipped  # where min picks the ratio term, which depends on logp
    grad = np.where(use_unclipped, -adv * ratio, 0.0) + kl_coef * (1 - np.exp(diff))
    return {"loss": pg + kl_coef * kl, "pg": pg, "kl": kl, "clipped": ~use_unclipped, "ratio": ratio, "grad": grad}


def reference_loss(samples: Sequence[dict], clip_eps: float, kl_coef: float, aggregation: str = "seq-mean-token-mean"):
    """The unpacked definition, sample by sample: each sample is a dict with per-token arrays
    `logp`, `old_logp`, `ref_logp` and a scalar `adv`. Returns (loss, pg, kl) as floats."""
    per = []
    for s in samples:
        terms = token_terms(s["logp"], s["old_logp"], s["ref_logp"], s["adv"], clip_eps, kl_coef)
        per.append((terms["loss"], terms["pg"], terms["kl"]))
    if aggregation == "seq-mean-token-mean":
        return tuple(float(np.mean([x[k].mean() for x in per])) for k in range(3))
    if aggregation == "token-mean":
        return tuple(float(np.concatenate([x[k] for x in per]).mean()) for k in range(3))
    if aggregation == "seq-mean-token-sum":
        return tuple(float(np.mean([x[k].sum() for x in per])) for k in range(3))
    raise RLHFError(f"unknown loss aggregation {aggregation!r}; expected one of {AGGREGATIONS}")


# ------------------------------------------------------------------------------------ row layout
@dataclass(frozen=True)
class Row:
    """One training row: samples back to back (a pack, or one padded sample), padded to a width."""

    input_ids: np.ndarray
    """[W] token ids (padding: pad id)."""
    positions: np.ndarray
    """[W] position of each token in its own sample."""
    segment_ids: np.ndarray
    """[W] sample index within the row; padding is one extra segment."""
    targets: np.ndarray
    """[W] the token each logit position predicts (0 where it is not a loss position)."""
    sample_of: np.ndarray
    """[W] global sample id whose response token position t predicts, -1 elsewhere."""
    resp_index: np.ndarray
    """[W] index of that token within its sample's response, -1 elsewhere."""
    num_tokens: int
    """Real (unpadded) tokens in the row."""


def build_row(
    sample_ids: Sequence[int],
    sequences: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    width: int | None = None,
    pad_id: int = 0,
) -> Row:
    """The row holding `sample_ids` (indices into `sequences`, each prompt + response tokens)."""
    ids, pos, seg, tgt, owner, ridx = [], [], [], [], [], []
    for k, s in enumerate(sample_ids):
        seq = np.asarray(sequences[s], dtype=np.int64)
        n, p = len(seq), int(prompt_lens[s])
        if not 1 <= p < n:
            raise RLHFError(f"sample {s}: prompt length {p} must be >= 1 and < its {n} tokens (a response is needed)")
        ids.append(seq)
        pos.append(np.arange(n))
        seg.append(np.full(n, k))
        t = np.zeros(n, np.int64)
        t[:-1] = seq[1:]
        tgt.append(t)
        o = np.full(n, -1, np.int64)
        r = np.full(n, -1, np.int64)
        o[p - 1 : n - 1] = s
        r[p - 1 : n - 1] = np.arange(n - p)
        owner.append(o)
        ridx.append(r)
    total = int(sum(len(x) for x in ids))
    width = total if width is None else width
    if width < total:
        raise RLHFError(f"row of {total} tokens does not fit width {width}")
    pad = width - total
    cat = lambda xs, fill: np.concatenate([*xs, np.full(pad, fill, np.int64)])  # noqa: E731
    return Row(
        input_ids=cat(ids, pad_id).astype(np.int32),
        positions=np.concatenate([*pos, np.arange(pad)]).astype(np.int32),
        segment_ids=cat(seg, len(sample_ids)).astype(np.int32),
        targets=cat(tgt, 0).astype(np.int32),
        sample_of=cat(owner, -1),
        resp_index=cat(ridx, -1),
        num_tokens=total,
    )


def per_token(row: Row, per_sample: Sequence[float]) -> np.ndarray:
    """A per-sample scalar spread over the row's loss positions (0 elsewhere), float32."""
    values = np.asarray(per_sample, dtype=np.float64)
    out = np.zeros(row.sample_of.shape, np.float64)
    mask = row.sample_of >= 0
    out[mask] = values[row.sample_of[mask]]
    return out.astype(np.float32)


def _flat(per_sample: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    lens = np.array([len(v) for v in per_sample], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens)[:-1]]) if len(lens) else lens
    flat = np.concatenate([np.asarray(v, np.float32) for v in per_sample]) if len(lens) else np.zeros(0, np.float32)
    return flat, offsets


def per_response_token(row: Row, per_sample: Sequence[np.ndarray]) -> np.ndarray:
    """Per-sample arrays over response tokens (e.g. old log-probs) placed at the row's loss positions."""
    flat, offsets = _flat(per_sample)
    out = np.zeros(row.sample_of.shape, np.float32)
    mask = row.sample_of >= 0
    out[mask] = flat[offsets[row.sample_of[mask]] + row.resp_index[mask]]
    return out


def scatter_response(rows: Sequence[Row], values: Sequence[np.ndarray], response_lengths: Sequence[int]):
    """Inverse of per_response_token: per-row arrays of log-probs -> per sample response arrays."""
    flat, offsets = _flat([np.zeros(int(n), np.float32) for n in response_lengths])
    for row, vals in zip(rows, values):
        mask = row.sample_of >= 0
        flat[offsets[row.sample_of[mask]] + row.resp_index[mask]] = np.asarray(vals, np.float32)[mask]
    return [flat[o : o + int(n)].copy() for o, n in zip(offsets, response_lengths)]
