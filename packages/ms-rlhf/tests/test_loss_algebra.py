"""The GRPO loss over packs, micro-batches and DP ranks equals the unpacked loss exactly, in numpy.

Every split is random: samples into packs (the packer, or any random grouping), packs into
micro-batches, micro-batches onto DP ranks. Each micro-batch's loss is sum(w * l) over its rows
(built with loss.build_row, so the token alignment is tested too); the step's loss is the sum over
micro-batches and ranks. The gradient w.r.t. every response log-prob is checked against a finite
difference of the unpacked definition."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_rlhf import AGGREGATIONS, build_row, group_advantages, pack, reference_loss, sample_weights, token_terms
from ms_rlhf.loss import per_response_token, per_token, scatter_response

CLIP, BETA = 0.2, 0.05


def make_batch(seed, num_prompts, n, max_prompt=4, max_resp=9):
    rng = np.random.default_rng(seed)
    samples, sequences, prompt_lens = [], [], []
    rewards = rng.random(num_prompts * n)
    adv = group_advantages(rewards, n)
    for s in range(num_prompts * n):
        p, r = int(rng.integers(1, max_prompt + 1)), int(rng.integers(1, max_resp + 1))
        sequences.append(rng.integers(3, 20, p + r))
        prompt_lens.append(p)
        logp = -rng.random(r) * 3
        samples.append(
            {
                "logp": logp,
                "old_logp": logp + rng.normal(0, 0.3, r),
                "ref_logp": logp + rng.normal(0, 0.3, r),
                "adv": adv[s],
            }
        )
    return samples, sequences, prompt_lens


def split_randomly(items, parts, rng):
    cuts = sorted(rng.choice(np.arange(1, len(items)), size=min(parts, len(items)) - 1, replace=False).tolist())
    return [list(x) for x in np.split(np.asarray(items), cuts)]


def packed_step(samples, sequences, prompt_lens, packs, micro_batches, ranks, aggregation):
    """Loss and d loss / d logp the way the trainer computes them: per row, weights from whole-step counts."""
    resp_lens = [len(s["logp"]) for s in samples]
    w = sample_weights(resp_lens, aggregation)
    adv = [s["adv"] for s in samples]
    total, grads, rows, row_grads = 0.0, [], [], []
    for rank in ranks:
        for mb in rank:
            width = max(sum(len(sequences[i]) for i in packs[k]) for k in micro_batches[mb])  # pad to the longest row
            for k in micro_batches[mb]:
                row = build_row(packs[k], sequences, prompt_lens, width)
                logp = per_response_token(row, [s["logp"] for s in samples]).astype(np.float64)
                old = per_response_token(row, [s["old_logp"] for s in samples]).astype(np.float64)
                ref = per_response_token(row, [s["ref_logp"] for s in samples]).astype(np.float64)
                weights = np.zeros(len(row.sample_of))
                mask = row.sample_of >= 0
                weights[mask] = w[row.sample_of[mask]]
                terms = token_terms(logp, old, ref, per_token(row, adv).astype(np.float64), CLIP, BETA)
                total += float((weights * terms["loss"]).sum())
                rows.append(row)
                row_grads.append(weights * terms["grad"])
    grads = scatter_response(rows, row_grads, resp_lens)
    return total, grads


def to_float32(samples):
    # the row builders carry float32 (what the model sees); compare in the same precision
    return [{k: np.asarray(v, np.float32).astype(np.float64) for k, v in s.items()} for s in samples]


@settings(max_examples=120, deadline=None)
@given(
    st.integers(0, 10_000),
    st.integers(1, 4),
    st.integers(1, 5),
    st.integers(1, 4),
    st.sampled_from(AGGREGATIONS),
    st.booleans(),
)
def test_packed_loss_equals_unpacked_for_any_split(seed, num_prompts, n, dp, aggregation, use_packer):
    samples, sequences, prompt_lens = make_batch(seed, num_prompts, n)
    samples = to_float32(samples)
    rng = np.random.default_rng(seed + 1)
    lengths = [len(s) for s in sequences]
    if use_packer:
        packs = pack(lengths, max(lengths) + int(rng.integers(0, 20)), int(rng.integers(1, 5)))
    else:
        packs = split_randomly(rng.permutation(len(lengths)).tolist(), int(rng.integers(1, len(lengths) + 1)), rng)
    micro_batches = split_randomly(rng.permutation(len(packs)).tolist(), int(rng.integers(1, len(packs) + 1)), rng)
    ranks = [[] for _ in range(dp)]
    for m in range(len(micro_batches)):
        ranks[int(rng.integers(0, dp))].append(m)
    want = reference_loss(samples, CLIP, BETA, aggregation)[0]
    got, grads = packed_step(samples, sequences, prompt_lens, packs, micro_batches, ranks, aggregation)
    assert got == pytest.approx(want, rel=1e-10, abs=1e-14)

    # d loss / d logp of one token per sample, by central differences of the unpacked definition
    for s, g in enumerate(grads):
        t = int(rng.integers(0, len(g)))
        h = 1e-4
        bumped = [dict(x) for x in samples]
        up = bumped[s]["logp"].copy()
        up[t] += h
        bumped[s]["logp"] = up
        f_up = reference_loss(bumped, CLIP, BETA, aggregation)[0]
        up[t] -= 2 * h
        f_down = reference_loss(bumped, CLIP, BETA, aggregation)[0]
        fd = (f_up - f_down) / (2 * h)
        ratio = np.exp(samples[s]["logp"][t] - samples[s]["old_logp"][t])
        if abs(abs(ratio - 1) - CLIP) > 1e-3:  # away from the clip kink
            assert g[t] == pytest.approx(fd, rel=1e-3, abs=1e-6)


def test_per_micro_batch_means_are_wrong():
    """The bug the weights avoid: a token mean per micro-batch, averaged over micro-batches."""
    samples, sequences, _ = make_batch(3, 2, 4)
    want = reference_loss(samples, CLIP, BETA)[0]
    packs = pack([len(s) for s in sequences], 12, 3)
    naive = []
    for p in packs:
        terms = [
            token_terms(
                samples[i]["logp"], samples[i]["old_logp"], samples[i]["ref_logp"], samples[i]["adv"], CLIP, BETA
            )["loss"]
            for i in p
        ]
        naive.append(np.concatenate(terms).mean())
    assert abs(np.mean(naive) - want) > 1e-3


def test_row_alignment():
    # prompt [1, 5], response [6, 7, 2]: logits at positions 1, 2, 3 predict 6, 7, 2
    row = build_row([0, 1], [[1, 5, 6, 7, 2], [1, 9, 2]], [2, 2], width=10)
    assert row.input_ids.tolist() == [1, 5, 6, 7, 2, 1, 9, 2, 0, 0]
    assert row.targets[:4].tolist() == [5, 6, 7, 2]
    assert row.sample_of.tolist() == [-1, 0, 0, 0, -1, -1, 1, -1, -1, -1]
    assert row.resp_index.tolist() == [-1, 0, 1, 2, -1, -1, 0, -1, -1, -1]
    assert row.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    assert row.segment_ids.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 2, 2]


def test_advantages_are_group_normalised():
    adv = group_advantages([1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5], 4)
    assert adv[:4] == pytest.approx([1, -1, -1, 1], abs=1e-5)
    assert adv[4:] == pytest.approx([0, 0, 0, 0])
