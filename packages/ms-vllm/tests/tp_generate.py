"""Run by test_tp.py in a fresh interpreter: greedy tokens through vllm.LLM with the given options.

A separate process because vLLM forks its tensor-parallel workers, which is only safe from a
process that has not started MindSpore's runtime (the test process has: it computes the reference;
the platform would then spawn them, a fresh import of vLLM each).
argv[1] is a JSON list of jobs {"model", "prompts", "follow_up", "n", "llm": {LLM kwargs}}, run one
engine after the other (one interpreter: importing vLLM costs ~20 s of CPU here); the last stdout
line is the JSON list of their results {"tokens", "follow_up", "cached", "shards", "eager_calls",
"compiled_calls", "steps", "forwards"} (the last four per rank)."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main() -> None:
    print(json.dumps([generate(job) for job in json.loads(sys.argv[1])]), flush=True)


def generate(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    args = dict(max_model_len=96, block_size=4, max_num_seqs=8, kv_cache_memory_bytes=4 << 20, seed=0)
    args.update(job["llm"])
    llm = LLM(model=job["model"], **args)
    greedy = SamplingParams(max_tokens=job["n"], temperature=0.0, ignore_eos=True)
    try:
        loras = None
        if job.get("loras"):  # [name, id, path] or None per prompt
            from vllm.lora.request import LoRARequest

            loras = [None if x is None else LoRARequest(x[0], x[1], x[2]) for x in job["loras"]]
        prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
        outs = llm.generate(prompts, greedy, lora_request=loras, use_tqdm=False)
        follow = llm.generate([{"prompt_token_ids": job["follow_up"]}], greedy, use_tqdm=False)[0]
        shards = llm.collective_rpc("ms_vllm_shard_info")
        stats = llm.collective_rpc("ms_vllm_stats")
    finally:
        llm.llm_engine.engine_core.shutdown()
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "follow_up": list(follow.outputs[0].token_ids),
        "cached": follow.num_cached_tokens or 0,
        "shards": shards,
        "eager_calls": [st["eager_calls"] for st in stats],
        "compiled_calls": [st["compiled_calls"] for st in stats],
        "steps": [st["steps"] for st in stats],
        "forwards": [st["forwards"] for st in stats],
        "drafts": [st["drafts"] for st in stats],
        "draft_calls": [(st.get("draft_compiled_calls", 0), st.get("draft_eager_calls", 0)) for st in stats],
    }
    return result


if __name__ == "__main__":
    main()
