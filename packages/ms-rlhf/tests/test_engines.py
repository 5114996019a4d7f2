"""Rollout engines: keyed sampling makes a request's tokens independent of batching and placement;
the paged KV-cache path and the compiled recompute path sample the same tokens."""

from __future__ import annotations

import numpy as np
import pytest

from ms_rlhf import contiguous_split, make_task, uniform_split

pytestmark = pytest.mark.needs_mindspore


@pytest.fixture(scope="module")
def model():
    import mindspore as ms

    import ms_models

    ms.set_device("CPU")
    cfg = ms_models.tiny_config("llama", vocab_size=15, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    return ms_models.from_config(cfg, seed=1)


def requests(num_prompts=4, n=3, max_new=5):
    from ms_rlhf.runtime.rollout import Request

    task = make_task("add", max_operand=9)
    rng = np.random.default_rng(0)
    prompts = [task.tokenizer.encode(task.sample(rng).text) for _ in range(num_prompts)]
    return [Request(p * n + j, tuple(prompts[p]), (7, 0, p * n + j), max_new) for p in range(num_prompts)
            for j in range(n)]  # fmt: skip


def test_paged_and_jit_paths_sample_the_same_tokens(model):
    from ms_rlhf.runtime.rollout import EmbeddedEngine

    reqs = requests()
    paged = EmbeddedEngine(model, eos_id=2, mode="paged", block_size=4).generate(reqs)
    jit = EmbeddedEngine(model, eos_id=2, mode="jit").generate(reqs, batch=len(reqs))
    assert [c.tokens for c in paged] == [c.tokens for c in jit]
    for a, b in zip(paged, jit):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert {len(c.tokens) for c in paged} != {5}  # some stopped at </s>, some ran to max_new


def test_uniform_and_contiguous_placement_give_the_same_samples(model):
    from ms_rlhf.runtime.rollout import EmbeddedEngine

    engine = EmbeddedEngine(model, eos_id=2, mode="jit")
    reqs = requests()
    results = []
    for assignment in (uniform_split(4, 3, 3), contiguous_split(4, 3, 3)):
        outs = [engine.generate([reqs[r] for r in inst], batch=4) for inst in assignment.instances]
        results.append([c.tokens for c in assignment.restore(outs)])
    assert results[0] == results[1]
    assert [c.request_id for c in assignment.restore(outs)] == list(range(12))


def test_scripted_lengths(model):
    from dataclasses import replace

    from ms_rlhf.runtime.rollout import EmbeddedEngine

    reqs = [replace(r, stop_after=2 + r.request_id % 4) for r in requests(2, 4, max_new=8)]
    outs = EmbeddedEngine(model, eos_id=2, mode="paged", block_size=4).generate(reqs)
    assert [len(c.tokens) for c in outs] == [2 + r.request_id % 4 for r in reqs]


@pytest.mark.parametrize("mode", ["paged", "jit"])
def test_concurrency_cap_does_not_change_samples(model, mode):
    from ms_rlhf.runtime.rollout import EmbeddedEngine

    engine = EmbeddedEngine(model, eos_id=2, mode=mode, block_size=4)
    reqs = requests()
    all_at_once = engine.generate(reqs, batch=len(reqs))
    capped = engine.generate(reqs, batch=3)  # continuous batching through 3 places
    assert [c.tokens for c in capped] == [c.tokens for c in all_at_once]
