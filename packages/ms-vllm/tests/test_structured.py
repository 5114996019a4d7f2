"""Structured outputs: vLLM's grammar bitmask applied in the plugin's sampler (structured.py)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from conftest import JSON_SCHEMA as SCHEMA
from conftest import close_llm, make_llm

pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch]


def test_bitmask_matches_xgrammar_on_the_same_logits():
    """Our numpy unpacking of the int32 bitmask against xgrammar's own kernel (torch, CPU)."""
    import torch
    import xgrammar

    from ms_vllm.structured import allowed_tokens

    rng = np.random.default_rng(0)
    vocab = 77  # not a multiple of 32: the last word is partly padding
    bitmask = rng.integers(-(2**31), 2**31, (5, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    logits = rng.normal(size=(5, vocab)).astype(np.float32)
    theirs = torch.from_numpy(logits.copy())
    xgrammar.apply_token_bitmask_inplace(theirs, torch.from_numpy(bitmask))
    ours = np.where(allowed_tokens(bitmask, vocab), logits, -np.inf)
    np.testing.assert_array_equal(ours, theirs.numpy())


def test_choice_regex_and_json_schema_through_llm(tiny_dirs):
    """Greedy and sampled requests under each kind of constraint, mixed with a free request in one
    batch: every constrained text obeys its constraint and stops; the free one is unaffected."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams as S

    llm = make_llm(
        tiny_dirs["llama"], structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True}
    )
    try:
        free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        plain = llm.generate(["hello there"], free, use_tqdm=False)[0].outputs[0].token_ids
        kinds = {
            "choice": (S(choice=["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
            "regex": (S(regex="[0-9]{3}-[a-c]{2}"), lambda t: re.fullmatch("[0-9]{3}-[a-c]{2}", t) is not None),
            "json": (S(json=SCHEMA), lambda t: _fits_schema(json.loads(t))),
        }
        for name, (constraint, ok) in kinds.items():
            for temperature in (0.0, 1.0):
                params = SamplingParams(max_tokens=40, temperature=temperature, seed=3, structured_outputs=constraint)
                outs = llm.generate(["hello there", "the cat", "hello there"], [params, params, free], use_tqdm=False)
                for out in outs[:2]:
                    text = out.outputs[0].text
                    assert ok(text) and out.outputs[0].finish_reason == "stop", (name, temperature, text)
                assert outs[2].outputs[0].token_ids == plain  # the free request in the same batch
    finally:
        close_llm(llm)


def _fits_schema(value) -> bool:
    return set(value) == {"answer", "n"} and value["answer"] in ("yes", "no") and value["n"] in range(10)
