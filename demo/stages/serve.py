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

from common import PROMPTS, StageResult, setup_mindspore, timed


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


def run(config: ServeConfig, work: Path) -> StageResult:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import ms_models
    from vllm import LLM, SamplingParams

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
        outs = llm.generate(list(PROMPTS), SamplingParams(max_tokens=config.max_tokens, temperature=0), use_tqdm=False)
        generate_s = time.perf_counter() - start
        platform = type(llm.llm_engine.vllm_config.device_config).__module__
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()

        setup_mindspore(1)
        model = ms_models.from_pretrained(serve_dir)
        prompts = [list(o.prompt_token_ids) for o in outs]
        reference = ms_models.generate_greedy(model, prompts, config.max_tokens)
        answers = []
        for out, ref in zip(outs, reference):
            got = list(out.outputs[0].token_ids)
            answers.append(
                {
                    "prompt": out.prompt,
                    "text": out.outputs[0].text,
                    "tokens": got,
                    "reference": ref,
                    "equal": got == ref,
                }
            )
        result.check(
            "vLLM greedy tokens == ms-models reference generation",
            all(a["equal"] for a in answers),
            f"{sum(a['equal'] for a in answers)}/{len(answers)} prompts, {config.max_tokens} tokens each",
        )
        from vllm.platforms import current_platform

        result.check(
            "served by ms-vllm's MindSpore platform",
            "mindspore" in type(current_platform).__module__.lower() or "ms_vllm" in type(current_platform).__module__,
            f"platform {type(current_platform).__module__}.{type(current_platform).__name__}",
        )
        tokens = sum(len(a["tokens"]) for a in answers)
        result.numbers = {
            "answers": answers,
            "engine_startup_s": startup,
            "generate_s": generate_s,
            "tokens_per_s": tokens / generate_s if generate_s else 0.0,
            "device_config": platform,
        }
    return result
