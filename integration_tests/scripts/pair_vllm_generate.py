"""Serve an HF directory with vllm.LLM (the ms-vllm plugin is picked through vLLM's entry points)
and write the greedy tokens of each prompt as JSON: `python pair_vllm_generate.py DIR PROMPTS.json N OUT.json`.

Its own process, as a server would be: vLLM's engine core runs in it (V1 multiprocessing off, so
one MindSpore runtime), and nothing of the caller's MindSpore state leaks in."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm is imported
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main(path: str, prompts_file: str, n: int, out: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    prompts = json.loads(open(prompts_file).read())
    llm = LLM(
        model=path, max_model_len=96, block_size=4, max_num_seqs=8, kv_cache_memory_bytes=4 << 20, seed=0,
        enforce_eager=True,
    )  # fmt: skip
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = {"platform": type(current_platform).__name__, "tokens": [list(o.outputs[0].token_ids) for o in outs]}
    llm.llm_engine.engine_core.shutdown()
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
