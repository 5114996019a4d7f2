"""Packed versus unpacked on a tiny ms_models Llama: the GRPO loss within 1e-6 and its gradients
within 1e-5, for several random splits into packs, micro-batches and DP ranks.

The unpacked reference is the definition, written independently of the weight machinery: each
sample alone in a row of its own, its response-token terms averaged with .mean(), divided by S,
gradients summed over samples. The packed side is what the trainer runs: ms_rlhf.pack, build_row,
sample_weights and PolicyFunctions, gradients summed over micro-batches and over simulated DP
ranks (the all-reduce SUM)."""

from __future__ import annotations

import numpy as np
import pytest

from ms_rlhf import build_row, pack, sample_weights

pytestmark = pytest.mark.needs_mindspore

CLIP, BETA, WIDTH, ROWS = 0.2, 0.05, 32, 2


@pytest.fixture(scope="module")
def setup():
    import mindspore as ms

    import ms_models

    ms.set_device("CPU")
    cfg = ms_models.tiny_config("llama", vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    model = ms_models.from_config(cfg, seed=3)
    rng = np.random.default_rng(0)
    # two (prompt, response) shapes keep the reference's compiled graphs to two; responses of 5
    # and 9 tokens weigh differently, which is what a wrong aggregation gets wrong
    shapes = [(3, 5), (2, 9), (3, 5), (3, 5), (2, 9), (3, 5), (2, 9), (3, 5), (2, 9)]
    sequences = [rng.integers(3, 16, p + r) for p, r in shapes]
    prompt_lens = [p for p, _ in shapes]
    adv = rng.normal(size=len(shapes)).astype(np.float32).astype(np.float64)
    # old/ref log-probs near the model's, so ratios straddle the clip range
    resp = [r for _, r in shapes]
    old = [rng.normal(-2.7, 0.3, n).astype(np.float32) for n in resp]
    ref = [rng.normal(-2.7, 0.3, n).astype(np.float32) for n in resp]
    want = reference(model, sequences, prompt_lens, adv, old, ref)
    return model, sequences, prompt_lens, adv, old, ref, want


@pytest.fixture(scope="module")
def fns(setup):
    from ms_rlhf.runtime.policy import PolicyFunctions

    return PolicyFunctions(setup[0], CLIP, BETA, jit=True)


def reference(model, sequences, prompt_lens, adv, old, ref):
    """Loss and gradients by the definition: per-sample token means, mean over samples."""
    import mindspore as ms
    from mindspore import ops

    params = model.trainable_params()
    num = len(sequences)

    def sample_loss(ids, targets, old_t, ref_t, a, start):
        logp = ops.gather_elements(ops.log_softmax(model(ids), -1), -1, targets.expand_dims(-1)).squeeze(-1)[0]
        logp = logp[start:]  # logit positions prompt-1 .. end-1 predict the response tokens
        ratio = ops.exp(logp - old_t)
        pg = -ops.minimum(ratio * a, ops.clamp(ratio, 1 - CLIP, 1 + CLIP) * a)
        kl = ops.exp(ref_t - logp) - (ref_t - logp) - 1
        return (pg + BETA * kl).mean() / num

    grad_fn = ms.jit(ms.value_and_grad(sample_loss, None, params))
    total, grads = 0.0, [np.zeros(p.shape, np.float64) for p in params]
    for s, seq in enumerate(sequences):
        p = prompt_lens[s]
        ids, targets = seq[None, :-1].astype(np.int32), seq[None, 1:].astype(np.int32)
        loss, g = grad_fn(ms.Tensor(ids), ms.Tensor(targets), ms.Tensor(old[s]), ms.Tensor(ref[s]),
                          ms.Tensor(np.float32(adv[s])), p - 1)  # fmt: skip
        total += float(loss.asnumpy())
        grads = [acc + x.asnumpy() for acc, x in zip(grads, g)]
    return total, grads


def packed(fns, sequences, prompt_lens, adv, old, ref, packs, micro_batches, ranks):
    """What the trainer does: weights from whole-step counts, sums over micro-batches and ranks."""
    from ms_rlhf.loss import per_response_token, per_token

    w = sample_weights([len(s) - p for s, p in zip(sequences, prompt_lens)])
    total, grads = 0.0, None
    for rank in ranks:
        rank_grads = None  # what this rank accumulates before the DP all-reduce
        for mb in rank:
            rows = [build_row(packs[k], sequences, prompt_lens, WIDTH) for k in micro_batches[mb]]
            rows += [build_row([], sequences, prompt_lens, WIDTH)] * (ROWS - len(rows))
            stats, g = fns.loss_and_grads(rows, [per_token(r, w) for r in rows], adv,
                                          [per_response_token(r, old) for r in rows],
                                          [per_response_token(r, ref) for r in rows])  # fmt: skip
            total += stats.loss
            rank_grads = g if rank_grads is None else [a + b for a, b in zip(rank_grads, g)]
        if rank_grads is not None:
            grads = rank_grads if grads is None else [a + b for a, b in zip(grads, rank_grads)]
    return total, grads


@pytest.mark.parametrize("split_seed", [0, 1, 2])
def test_packed_loss_and_gradients_equal_unpacked(setup, fns, split_seed):
    _, sequences, prompt_lens, adv, old, ref, (want_loss, want_grads) = setup
    rng = np.random.default_rng(100 + split_seed)

    lengths = [len(s) for s in sequences]
    packs = pack(lengths, WIDTH, int(rng.integers(1, 5)))
    order = rng.permutation(len(packs)).tolist()
    micro_batches = [order[i : i + ROWS] for i in range(0, len(order), ROWS)]
    dp = split_seed + 1  # one, two and three DP ranks
    ranks = [[] for _ in range(dp)]
    for m in range(len(micro_batches)):
        ranks[int(rng.integers(0, dp))].append(m)
    got_loss, got_grads = packed(fns, sequences, prompt_lens, adv, old, ref, packs, micro_batches, ranks)

    scale = max(float(np.abs(g).max()) for g in want_grads)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(got_grads, want_grads))
    print(
        f"split {split_seed}: {len(packs)} packs, dp={dp}: |dloss| {abs(got_loss - want_loss):.2e}, "
        f"max |dgrad| {worst:.2e} (grads up to {scale:.2e})"
    )
    assert len(packs) > 1 and abs(got_loss - want_loss) <= 1e-6, (got_loss, want_loss)
    assert scale > 1e-3 and worst <= 1e-5 * max(1.0, scale), (worst, scale)
