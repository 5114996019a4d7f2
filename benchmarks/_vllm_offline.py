"""Offline serving throughput: vllm.LLM with the ms-vllm plugin (compiled steps) against Hugging Face
transformers generate on the same 64 mixed-length requests, and against the plugin's eager path.

Used by `bench_vllm.py --model tiny|mid`. All variants run in this one process (vLLM's engine core
in-process), so each figure has wall time and the process CPU time beside it; HF generate gets its
best batch size (left padding, each batch decoding to its longest request) at 1 and 2 torch threads,
and only the tokens the requests asked for are counted for both stacks. The eager plugin is measured
on a subset (it is ~35x slower) against the compiled plugin on the same subset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

MODELS = {
    "tiny": {},  # make_tiny's llama: hidden 64, 2 layers, vocab 320 (115k parameters)
    # the "mid" llama: hidden 512, 8 layers, 8 heads, vocab 32000 (58.5M parameters)
    "mid": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=512,
    ),
}
N_REQUESTS = 64
MAX_MODEL_LEN = 256


def requests(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """n prompts of 8-96 tokens and output lengths of 8-48 tokens (uniform, seeded)."""
    rng = np.random.default_rng(seed)
    lens, outs = rng.integers(8, 97, n), rng.integers(8, 49, n)
    return [[0] + rng.integers(4, vocab, int(k) - 1).tolist() for k in lens], [int(o) for o in outs]


def timed(fn):
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t, time.process_time() - c


def engine(path: str, eager: bool, **kw):
    from vllm import LLM

    args = dict(
        model=path,
        max_model_len=MAX_MODEL_LEN,
        block_size=16,
        max_num_seqs=N_REQUESTS,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=128 << 20,
        seed=0,
        enforce_eager=eager,
        enable_prefix_caching=False,
    )
    args.update(kw)
    return LLM(**args)


def close(llm) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def run_vllm(llm, prompts, outs):
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outs]
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in res]


def stats(llm) -> dict:
    return llm.collective_rpc("ms_vllm_stats")[0]


def run_hf(model, prompts, outs, batch: int) -> list[list[int]]:
    import torch

    tokens = []
    for i in range(0, len(prompts), batch):
        chunk, want = prompts[i : i + batch], outs[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[2] * (width - len(p)) + p for p in chunk])  # left padding with <pad>
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in chunk])[:, None]).long()
        n = max(want)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
        tokens += [out[k, width : width + w].tolist() for k, w in enumerate(want)]
    return tokens


def figure(tokens: int, wall: float, cpu: float) -> dict:
    return dict(tok_s_wall=round(tokens / wall, 2), tok_per_cpu_s=round(tokens / cpu, 2), wall_s=round(wall, 3),
                cpu_s=round(cpu, 3))  # fmt: skip


def start_time(path: str, cache_dir: str) -> float:
    """(seconds to import and build a compiled engine in a fresh process with the compile cache at
    `cache_dir`, its seconds per bucket)."""
    env = dict(os.environ, MS_VLLM_COMPILE_CACHE=cache_dir)
    # a script file, not `python -c`: MindSpore's compile cache hashes the entry script's source
    # and fails on "-c" (FileNotFoundError: '.../-c')
    script = os.path.join(cache_dir, "start_engine.py")
    with open(script, "w") as f:
        f.write(
            "import sys, time, json\n"
            "t = time.perf_counter()\n"
            f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
            "import _vllm_offline as o\n"
            f"llm = o.engine({path!r}, False)\n"
            "print('START', json.dumps([time.perf_counter() - t, o.stats(llm)['compile_s']]))\n"
            "o.close(llm)\n"
        )
    out = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=1800)
    line = [x for x in out.stdout.splitlines() if x.startswith("START ")]
    if out.returncode or not line:
        raise RuntimeError(f"engine start failed: {out.stderr[-2000:]}")
    return json.loads(line[0][6:])


def offline(name: str, root: str, repeats: int = 2, eager_subset: int = 8, eager_tokens: int = 8) -> dict:
    """Every offline figure of one model; the summary ratios are taken side by side in this run."""
    import tempfile

    import torch
    import transformers

    import ms_models

    path = ms_models.make_tiny("llama", os.path.join(root, name), seed=0, **MODELS[name])
    vocab = MODELS[name].get("vocab_size", 320)
    prompts, outs = requests(N_REQUESTS, vocab)
    useful = sum(outs)
    sub_p, sub_o = prompts[:eager_subset], [min(o, eager_tokens) for o in outs[:eager_subset]]
    sub_useful = sum(sub_o)
    result: dict = {"model": name, "requests": N_REQUESTS, "output_tokens": useful, "eager_requests": eager_subset}

    # 1. the eager plugin first: its worker sets pynative_synchronize, which only works before the
    # process's first MindSpore op (docs/mindspore-cpu.md §14), as in a `vllm serve` worker.
    llm = engine(path, eager=True)
    eager_tokens_out = run_vllm(llm, sub_p, sub_o)  # warm-up
    best = None
    for _ in range(repeats):
        _, wall, cpu = timed(lambda: run_vllm(llm, sub_p, sub_o))
        best = (wall, cpu) if best is None or wall < best[0] else best
    result["eager_subset"] = figure(sub_useful, *best)
    close(llm)

    # 2. the compiled plugin: start-up (compiling every bucket), the subset, the 64 requests
    (llm, start_s, _) = timed(lambda: engine(path, eager=False))
    result["compiled_start_s"] = round(start_s, 2)
    compiled_sub = run_vllm(llm, sub_p, sub_o)
    result["compiled_equals_eager"] = compiled_sub == eager_tokens_out
    best = None
    for _ in range(repeats):
        _, wall, cpu = timed(lambda: run_vllm(llm, sub_p, sub_o))
        best = (wall, cpu) if best is None or wall < best[0] else best
    result["compiled_subset"] = figure(sub_useful, *best)
    run_vllm(llm, prompts, outs)  # warm-up of the full mix

    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_rows, ours_runs = [], []

    def ours_once():
        before = stats(llm)
        _, wall, cpu = timed(lambda: run_vllm(llm, prompts, outs))
        after = stats(llm)
        model_s = after["model_s"] - before["model_s"]
        step_s = after["step_s"] - before["step_s"]
        ours_runs.append(dict(figure(useful, wall, cpu), model_s=round(model_s, 3), step_s=round(step_s, 3),
                              eager_calls=after["eager_calls"] - before["eager_calls"],
                              compiled_calls=after["compiled_calls"] - before["compiled_calls"]))  # fmt: skip

    # alternate: ours, HF at every (threads, batch), ours, HF's best per thread count again, ours
    ours_once()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for batch in (8, 16, 32, 64):
            _, wall, cpu = timed(lambda b=batch: run_hf(hf, prompts, outs, b))
            hf_rows.append(dict(figure(useful, wall, cpu), threads=threads, batch=batch))
    for _ in range(repeats - 1):
        ours_once()
        for threads in (1, 2):
            torch.set_num_threads(threads)
            top = max((r for r in hf_rows if r["threads"] == threads), key=lambda r: r["tok_s_wall"])
            _, wall, cpu = timed(lambda b=top["batch"]: run_hf(hf, prompts, outs, b))
            hf_rows.append(dict(figure(useful, wall, cpu), threads=threads, batch=top["batch"], repeat=True))
        ours_once()
    final = stats(llm)
    close(llm)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    ours = max(ours_runs, key=lambda r: r["tok_s_wall"])
    hf_wall = max(hf_rows, key=lambda r: r["tok_s_wall"])
    hf_cpu = max(hf_rows, key=lambda r: r["tok_per_cpu_s"])
    result.update(
        ours=ours,
        ours_runs=ours_runs,
        hf=hf_rows,
        hf_best_wall=hf_wall,
        hf_best_cpu=hf_cpu,
        compile_s=final["compile_s"],
        eager_reasons=final["eager_reasons"],
    )
    # 3. cold vs warm start with MindSpore's compile cache: the same script in two fresh processes
    # (imports included; the cache is keyed by the entry script's source, among others)
    cache = tempfile.mkdtemp(prefix="ms-vllm-cc-")
    cold, _ = start_time(path, cache)
    warm, warm_compile = start_time(path, cache)
    result["start_cold_s"], result["start_warm_s"] = round(cold, 2), round(warm, 2)
    result["warm_compile_s"] = warm_compile
    result["summary"] = dict(
        ms_vllm_over_hf=round(ours["tok_s_wall"] / hf_wall["tok_s_wall"], 3),
        ms_vllm_over_hf_cpu=round(ours["tok_per_cpu_s"] / hf_cpu["tok_per_cpu_s"], 3),
        over_eager=round(result["compiled_subset"]["tok_s_wall"] / result["eager_subset"]["tok_s_wall"], 2),
        over_eager_cpu=round(result["compiled_subset"]["tok_per_cpu_s"] / result["eager_subset"]["tok_per_cpu_s"], 2),
        outside_model_share=round(1 - ours["model_s"] / ours["wall_s"], 3),
        outside_model_share_of_runner=round(1 - ours["model_s"] / ours["step_s"], 3),
        compile_total_s=round(sum(final["compile_s"].values()), 1),
        start_cold_s=result["start_cold_s"],
        start_warm_s=result["start_warm_s"],
    )
    return result


def rows_of(result: dict) -> list[dict]:
    """Table rows (benchmarks/summary.py prints and writes them) of one offline result."""
    s, m = result["summary"], result["model"]
    ours, hw, hc = result["ours"], result["hf_best_wall"], result["hf_best_cpu"]
    return [
        dict(
            case=f"{m}: offline 64 requests, ms-vllm compiled vs HF generate (best batch/threads)",
            ours=f"{ours['tok_s_wall']:.1f} tok/s wall, {ours['tok_per_cpu_s']:.1f} tok/CPU-s",
            baseline=f"{hw['tok_s_wall']:.1f} tok/s wall (batch {hw['batch']}, {hw['threads']} thr), "
            f"{hc['tok_per_cpu_s']:.1f} tok/CPU-s (batch {hc['batch']}, {hc['threads']} thr)",
            ratio=s["ms_vllm_over_hf"],
            ratio_cpu=s["ms_vllm_over_hf_cpu"],
            ours_tok_s_wall=ours["tok_s_wall"],
            ours_tok_per_cpu_s=ours["tok_per_cpu_s"],
            hf_tok_s_wall=hw["tok_s_wall"],
            hf_tok_per_cpu_s=hc["tok_per_cpu_s"],
            outside_model_share=s["outside_model_share"],
        ),
        dict(
            case=f"{m}: ms-vllm compiled vs eager, {result['eager_requests']} requests",
            ours=f"{result['compiled_subset']['tok_s_wall']:.1f} tok/s wall",
            baseline=f"{result['eager_subset']['tok_s_wall']:.2f} tok/s wall",
            ratio=s["over_eager"],
            ratio_cpu=s["over_eager_cpu"],
        ),
        dict(
            case=f"{m}: engine start, compile cache cold vs warm ({len(result['compile_s'])} buckets)",
            ours=f"{s['start_warm_s']:.1f} s warm",
            baseline=f"{s['start_cold_s']:.1f} s cold (compiling {s['compile_total_s']:.1f} s)",
            ratio=round(s["start_cold_s"] / s["start_warm_s"], 2),
        ),
    ]
