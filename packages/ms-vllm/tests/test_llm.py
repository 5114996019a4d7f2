"""Greedy generation through vllm.LLM with the plugin equals ms-models' reference, token for token,
for both families, with prefix caching and chunked prefill on and off."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ARCHS, close_llm, make_llm, token_prompts

pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch]

N_NEW = 5
SHARED = [0, *range(40, 52)]  # 13 tokens: three full blocks of 4 to share
PROMPTS = [
    SHARED + [7, 9],
    [0, 17, 23, 99, 5, 61, 200, 31, 8, 8, 150, 42, 19, 77, 240, 3, 66, 90, 12, 14, 130, 55, 71],  # > 16: chunked
    [0, 12],
]
FOLLOW_UP = SHARED + [101, 102, 103]  # sent after PROMPTS: its first 12 tokens are cached blocks


def greedy(n=N_NEW):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("features", ["prefix+chunked", "plain"])
def test_greedy_matches_reference(arch, features, tiny_dirs, reference):
    on = features == "prefix+chunked"
    kwargs = (
        dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16)
        if on
        else dict(enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=96)
    )
    llm = make_llm(tiny_dirs[arch], **kwargs)
    try:
        outs = llm.generate(token_prompts(PROMPTS), greedy(), use_tqdm=False)
        follow = llm.generate(token_prompts([FOLLOW_UP]), greedy(), use_tqdm=False)[0]
    finally:
        close_llm(llm)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == [reference(arch, p, N_NEW) for p in PROMPTS]
    assert list(follow.outputs[0].token_ids) == reference(arch, FOLLOW_UP, N_NEW)
    # The follow-up reused the cached blocks of the shared prefix (vLLM counts whole blocks).
    assert (follow.num_cached_tokens or 0) == (12 if on else 0)


def test_sampling_params_and_logprobs(tiny_dirs, reference):
    """Seeded sampling repeats, different seeds differ, top_k=1 is greedy, logprobs are consistent."""
    from vllm import SamplingParams

    llm = make_llm(tiny_dirs["qwen2"], enable_prefix_caching=True)
    prompt = token_prompts([[0, 30, 31, 32, 33]])
    try:

        def run(**kw):
            params = SamplingParams(max_tokens=8, ignore_eos=True, **kw)
            return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]

        a = run(temperature=1.5, top_p=0.95, seed=11).token_ids
        b = run(temperature=1.5, top_p=0.95, seed=11).token_ids
        others = [tuple(run(temperature=1.5, seed=s).token_ids) for s in (12, 13, 14)]
        top1 = run(temperature=1.0, top_k=1, seed=3).token_ids
        with_lp = run(temperature=0.0, logprobs=3)
    finally:
        close_llm(llm)
    assert list(a) == list(b)
    assert len(set(others) | {tuple(a)}) > 1
    greedy_ref = reference("qwen2", [0, 30, 31, 32, 33], 8)
    assert list(top1) == greedy_ref and list(with_lp.token_ids) == greedy_ref
    for token, entry in zip(with_lp.token_ids, with_lp.logprobs):
        assert entry[token].rank == 1
        assert len(entry) >= 3
        assert all(np.isfinite(e.logprob) and e.logprob <= 0 for e in entry.values())
