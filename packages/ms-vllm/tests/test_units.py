"""Pure host-side pieces: the flat batch builder and the numpy sampler."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ms_vllm.batch import RequestState, build_batch
from ms_vllm.sampler import SamplingRow, logprobs_of, sample_row


def params(**kw):
    base = dict(
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        min_tokens=0,
        logit_bias=None,
        allowed_token_ids=None,
        all_stop_token_ids=set(),
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_batch_mixes_prefill_chunk_decode_and_drafts():
    states = {
        "a": RequestState("a", list(range(10)), None, [3, 7, 1], num_computed_tokens=4),  # chunk 4..7
        "b": RequestState("b", [5, 6], None, [2], num_computed_tokens=2, output_token_ids=[9]),  # decode
        "c": RequestState("c", [1, 2, 3], None, [4, 5], num_computed_tokens=3, output_token_ids=[8]),  # + 2 drafts
    }
    batch = build_batch(states, {"a": 4, "b": 1, "c": 3}, {"c": [11, 12]}, block_size=4)
    assert batch.input_ids.tolist() == [4, 5, 6, 7, 9, 8, 11, 12]
    assert batch.positions.tolist() == [4, 5, 6, 7, 2, 3, 4, 5]
    # position p of a request lives in block_ids[p // 4] at offset p % 4
    assert batch.slot_mapping.tolist() == [28, 29, 30, 31, 10, 19, 20, 21]
    assert batch.seq_lens.tolist() == [8, 3, 6]
    assert batch.query_start_loc.tolist() == [0, 4, 5, 8]
    assert batch.sample_rows == [[], [4], [5, 6, 7]]  # chunk: nothing; drafts verified at their rows
    assert batch.block_tables.tolist() == [[3, 7, 1], [2, 0, 0], [4, 5, 0]]


def test_batch_refuses_positions_without_blocks():
    states = {"a": RequestState("a", list(range(9)), None, [0, 1], num_computed_tokens=0)}
    with pytest.raises(IndexError, match="past the 2 blocks"):
        build_batch(states, {"a": 9}, {}, block_size=4)


def test_sampler_distribution_matches_top_k_top_p():
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    p = params(temperature=1.0, top_k=4, top_p=0.7)
    row = SamplingRow(p, np.random.default_rng(0), [], [])
    draws = np.bincount([sample_row(logits, row, None) for _ in range(4000)], minlength=6) / 4000
    # top-k keeps 4, renormalised: [.444, .278, .167, .111]; top-p 0.7 keeps the first two (.444 + .278 >= .7)
    expect = np.array([0.4, 0.25, 0, 0, 0, 0]) / 0.65
    assert np.abs(draws - expect).max() < 0.03


def test_sampler_greedy_penalties_and_min_tokens():
    logits = np.array([0.0, 3.0, 2.9, 1.0])
    assert sample_row(logits, SamplingRow(params(), None, [], []), None) == 1
    # a repetition penalty on the generated token 1 lets token 2 win
    rep = SamplingRow(params(repetition_penalty=1.5), None, [0], [1])
    assert sample_row(logits, rep, None) == 2
    # min_tokens masks the stop tokens until enough tokens were generated
    stop = SamplingRow(params(min_tokens=2, all_stop_token_ids={1, 2}), None, [], [3])
    assert sample_row(logits, stop, None) == 3


def test_logprobs_rank_and_values():
    logits = np.array([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])
    ids, vals, ranks = logprobs_of(logits, np.array([2, 2]), 2)
    assert ids.tolist() == [[2, 1, 2], [2, 2, 0]]
    assert ranks.tolist() == [2, 1]
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert np.allclose(vals[0], ref[0, [2, 1, 2]], atol=1e-6)


@pytest.mark.needs_mindspore
def test_mindspore_runtime_started_only_after_a_first_operation():
    """Importing MindSpore starts no thread, so vLLM may still fork; its first operation starts the
    runtime's threads, and the platform then asks for spawned children (a fresh interpreter: the
    test process has run MindSpore already)."""
    import subprocess
    import sys

    code = (
        "from ms_vllm.forking import mindspore_runtime_started as started\n"
        "a = started(); import mindspore as ms, numpy as np; b = started()\n"
        "ms.set_device('CPU'); (ms.Tensor(np.ones((2, 2), np.float32)) * 2).asnumpy()\n"
        "print(a, b, started())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.split() == ["False", "False", "True"]
