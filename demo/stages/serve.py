"""Stage 4: serve the resharded checkpoint through vLLM with ms-vllm and answer a few prompts.

``vllm.LLM`` finds ms-vllm's platform plugin through its entry points and runs the MindSpore
model over the plugin's paged KV cache; vLLM keeps its scheduler, block manager and sampler.
Greedy answers must equal ms-models' own paged greedy generation on the same weights, token for
token. The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as ms-vllm's
tests run it): one MindSpore runtime, and nothing forks a process that already loaded it.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import PROMPTS, StageResult, setup_mindspore, timed
from tolerance import Rtol, float32_rtol


@dataclass(frozen=True)
class ServeConfig:
    """How vLLM serves."""

    max_tokens: int = 8
    """New tokens per prompt (greedy)."""
    max_model_len: int = 96
    """vLLM's context limit."""
    block_size: int = 4
    """KV-cache block size (tokens)."""
    kv_cache_bytes: int = 4 << 20
    """KV-cache memory for vLLM to carve into blocks."""
    rtol_scale: float = 1.0
    """Multiplies the float32 rounding bound on the log-probs (tolerance.float32_rtol)."""


def _logprobs(model, prompt: list[int], answer: list[int]) -> tuple[np.ndarray, float]:
    """Log-probabilities of `answer` after `prompt` from one training-path forward (no KV cache):
    an independent reference for what vLLM computed step by step over its paged cache; and the
    scale they are computed at, max |logit| over those positions."""
    import mindspore as ms
    from mindspore import ops

    ids = ms.Tensor(np.asarray([prompt + answer], np.int32))
    logits = model(ids)[0]
    logp = ops.log_softmax(logits, -1).asnumpy()
    rows = np.arange(len(prompt) - 1, len(prompt) + len(answer) - 1)
    return logp[rows, answer], float(np.abs(logits.asnumpy()[rows]).max())


def _rtol(config: ServeConfig, model_config) -> Rtol:
    """The float32 bound on one inference forward in another order (paged attention, other
    matmul shapes): one pass, one direction, the decoder layers and the head."""
    widest = max(
        model_config.hidden_size, model_config.intermediate_size, model_config.vocab_size, config.max_model_len
    )
    bound = float32_rtol(layers=model_config.num_hidden_layers + 1, widest=widest, passes=1, directions=1)
    return Rtol(bound.value * config.rtol_scale, bound.roundings, bound.derivation)


def run(config: ServeConfig, work: Path) -> StageResult:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its CPU-fallback notices are expected here
    from vllm import LLM, SamplingParams

    import ms_models

    result = StageResult("serve")
    with timed(result):
        serve_dir = str(work / "serve")
        start = time.perf_counter()
        llm = LLM(
            model=serve_dir, max_model_len=config.max_model_len, block_size=config.block_size, max_num_seqs=8,
            kv_cache_memory_bytes=config.kv_cache_bytes, seed=0, enforce_eager=True,
        )  # fmt: skip
        startup = time.perf_counter() - start
        start = time.perf_counter()
        params = SamplingParams(max_tokens=config.max_tokens, temperature=0, logprobs=1)
        outs = llm.generate(list(PROMPTS), params, use_tqdm=False)
        generate_s = time.perf_counter() - start
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()

        setup_mindspore(1)
        model = ms_models.from_pretrained(serve_dir)
        prompts = [list(o.prompt_token_ids) for o in outs]
        reference = ms_models.generate_greedy(model, prompts, config.max_tokens)
        answers, worst, scale = [], 0.0, 0.0
        for out, prompt, ref in zip(outs, prompts, reference):
            got = list(out.outputs[0].token_ids)
            served = [step[token].logprob for step, token in zip(out.outputs[0].logprobs, got)]
            expected, logit_scale = _logprobs(model, prompt, got)
            worst = max(worst, float(np.abs(np.asarray(served) - expected).max()))
            scale = max(scale, logit_scale)
            text = out.outputs[0].text
            answers.append({"prompt": out.prompt, "text": text, "tokens": got, "reference": ref, "equal": got == ref})
        result.check(
            "vLLM greedy tokens == ms-models reference generation",
            all(a["equal"] for a in answers),
            f"{sum(a['equal'] for a in answers)}/{len(answers)} prompts, {config.max_tokens} tokens each",
        )
        # log p = logit - logsumexp(logits): each term is off by at most rtol * max |logit|
        rtol = _rtol(config, model.config)
        tolerance = 2 * rtol.value * scale
        result.check(
            "vLLM's log-probs == the training-path forward's, within float32 rounding",
            worst <= tolerance,
            f"max |difference| {worst:.2e} over {sum(len(a['tokens']) for a in answers)} tokens; tolerance "
            f"{tolerance:.2e} = 2 x max |logit| {scale:.3g} x {rtol.value:.2e} ({rtol.derivation})",
        )
        from vllm.platforms import current_platform

        platform = f"{type(current_platform).__module__}.{type(current_platform).__name__}"
        result.check("served by ms-vllm's MindSpore platform", platform.startswith("ms_vllm."), platform)
        tokens = sum(len(a["tokens"]) for a in answers)
        result.numbers = {
            "answers": answers,
            "engine_startup_s": startup,
            "generate_s": generate_s,
            "tokens_per_s": tokens / generate_s if generate_s else 0.0,
            "logprob_max_abs_diff": worst,
            "logprob_tolerance": tolerance,
        }
    return result
