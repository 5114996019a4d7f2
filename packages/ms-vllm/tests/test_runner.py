"""The model runner driven step by step with vLLM's own SchedulerOutput objects: draft verification
(accepted and rejected drafts, the scheduler's rollback) and the MTP drafter against ms-models'
training-path MTP."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch]

PROMPT = [0, 21, 22, 23, 24]
BLOCKS = [3, 1, 6, 2]  # 16 positions of block size 4, not contiguous


def runner_for(path, drafter_k=0):
    import mindspore as ms

    from ms_models import from_pretrained
    from ms_vllm.model_runner import MindSporeModelRunner
    from ms_vllm.spec_decode import MTPDrafter

    ms.set_device("CPU")
    model = from_pretrained(path)
    config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=4),
        model_config=SimpleNamespace(max_model_len=64, seed=0, get_vocab_size=lambda: model.config.vocab_size),
    )
    drafter = (
        MTPDrafter(model, SimpleNamespace(method="deepseek_mtp", num_speculative_tokens=drafter_k))
        if drafter_k
        else None
    )
    runner = MindSporeModelRunner(config, model, drafter=drafter)
    runner.initialize_kv_cache(8)
    return runner, model


def new_step(n):
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    params = SamplingParams(temperature=0.0, max_tokens=16)
    req = NewRequestData("r", PROMPT, [], params, None, (list(BLOCKS),), 0, None)
    return SchedulerOutput([req], CachedRequestData.make_empty(), {"r": n}, n, {}, {}, set(), [])


def cached_step(computed, outputs, drafts):
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    cached = CachedRequestData(["r"], set(), [], {}, [None], [computed], [outputs])
    n = 1 + len(drafts)
    return SchedulerOutput([], cached, {"r": n}, n, {"r": drafts} if drafts else {}, {}, set(), [])


def test_draft_verification_accepts_and_rolls_back(tiny_dirs, reference):
    runner, _ = runner_for(tiny_dirs["llama"])
    ref = reference("llama", PROMPT, 6)
    assert runner.execute(new_step(len(PROMPT))).sampled_token_ids == [[ref[0]]]
    # Two correct drafts: both accepted, plus the bonus token.
    out = runner.execute(cached_step(5, 1, [ref[1], ref[2]]))
    assert out.sampled_token_ids == [[ref[1], ref[2], ref[3]]]
    # A wrong first draft: rejected, the target's own token replaces it; the rest is discarded.
    wrong = (ref[4] + 1) % 320
    out = runner.execute(cached_step(8, 4, [wrong, ref[5]]))
    assert out.sampled_token_ids == [[ref[4]]]
    # The scheduler rolled num_computed_tokens back by the 2 rejected drafts: 8 + 3 - 2 = 9.
    assert runner.execute(cached_step(9, 5, [])).sampled_token_ids == [[ref[5]]]
    assert runner.stats["drafts"] == 4 and runner.stats["accepted"] == 2


def test_mtp_drafts_equal_training_path_mtp(tiny_dirs, reference):
    import mindspore as ms

    runner, model = runner_for(tiny_dirs["deepseek_v3"], drafter_k=1)
    ref = reference("deepseek_v3", PROMPT, 3)
    runner.execute(new_step(len(PROMPT)))
    req_ids, drafts = runner.pending_drafts
    # Reference: MTP over the whole prompt on the training path, next ids shifted by one.
    seq = np.array([PROMPT], np.int32)
    hidden = model.hidden_states(ms.Tensor(seq))
    nxt = np.array([[*PROMPT[1:], ref[0]]], np.int32)
    logits, _ = model.mtp_forward(hidden, ms.Tensor(nxt))
    assert req_ids == ["r"] and drafts == [[int(logits.asnumpy()[0, -1].argmax())]]
    # Next step verifies that draft; the MTP cache then extends by the accepted positions.
    out = runner.execute(cached_step(5, 1, drafts[0]))
    assert out.sampled_token_ids[0][0] == ref[1]
    full = [*PROMPT, *ref[: 1 + len(out.sampled_token_ids[0])]]
    hidden = model.hidden_states(ms.Tensor(np.array([full[:-1]], np.int32)))
    logits, _ = model.mtp_forward(hidden, ms.Tensor(np.array([full[1:]], np.int32)))
    assert runner.pending_drafts[1] == [[int(logits.asnumpy()[0, -1].argmax())]]
