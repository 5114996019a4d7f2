"""Multi-step decoding and MTP speculative decoding through vllm.LLM: same tokens as the reference."""

from __future__ import annotations

import pytest
from conftest import close_llm, make_llm, token_prompts

pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch]

PROMPTS = [[0, 5, 9, 33, 77, 100, 21], [0, 12], [0, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55]]


def greedy(n):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_multi_step_decoding(tiny_dirs, reference):
    """4 decode iterations per engine step: identical tokens, fewer engine steps than forwards."""
    llm = make_llm(
        tiny_dirs["llama"], additional_config={"multi_step": 4}, enable_prefix_caching=True, max_num_batched_tokens=16
    )
    try:
        outs = llm.generate(token_prompts(PROMPTS), greedy(7), use_tqdm=False)
        # max_tokens that is not a multiple of 4 and a stop token: the worker stops where the scheduler would
        stop_at = reference("llama", PROMPTS[0], 7)[2]
        from vllm import SamplingParams

        stopped = llm.generate(
            token_prompts(PROMPTS[:1]),
            SamplingParams(max_tokens=7, temperature=0.0, stop_token_ids=[stop_at]),
            use_tqdm=False,
        )[0]
        stats = llm.collective_rpc("ms_vllm_stats")[0]
    finally:
        close_llm(llm)
    assert [list(o.outputs[0].token_ids) for o in outs] == [reference("llama", p, 7) for p in PROMPTS]
    assert list(stopped.outputs[0].token_ids) == reference("llama", PROMPTS[0], 7)[:3]
    assert stats["forwards"] > stats["steps"]  # several decode iterations ran inside single engine steps


def test_mtp_speculative_decoding(tiny_dirs, reference):
    """DeepSeek-V3 with its MTP module drafting 2 tokens: identical greedy tokens; drafts were verified."""
    llm = make_llm(
        tiny_dirs["deepseek_v3"],
        speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2},
        enable_prefix_caching=True,
        max_num_batched_tokens=16,
    )
    try:
        outs = llm.generate(token_prompts(PROMPTS), greedy(6), use_tqdm=False)
        stats = llm.collective_rpc("ms_vllm_stats")[0]
    finally:
        close_llm(llm)
    assert [list(o.outputs[0].token_ids) for o in outs] == [reference("deepseek_v3", p, 6) for p in PROMPTS]
    assert stats["drafts"] > 0
    rate = stats["accepted"] / stats["drafts"]
    print(f"MTP acceptance rate (random tiny weights): {rate:.2f} of {stats['drafts']} drafts")
