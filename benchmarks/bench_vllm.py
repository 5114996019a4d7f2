"""ms-vllm on CPU: the vLLM plugin (MindSpore) against Hugging Face transformers generate (torch),
and the speedups of prefix caching, multi-step decoding and MTP, all measured side by side in one run.

    python benchmarks/bench_vllm.py [--quick] --out benchmarks/results/vllm.json

Same tiny checkpoints (ms_models.make_tiny) and token prompts for both stacks, greedy decoding.
Each figure is the best of `--repeats` runs of the same work (the box is shared), after a warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def prompts_for(n, length, seed, prefix=()):
    rng = np.random.default_rng(seed)
    return [list(prefix) + rng.integers(4, 320, length).tolist() for _ in range(n)]


def vllm_engine(path, **kw):
    from vllm import LLM

    args = dict(model=path, max_model_len=256, block_size=16, kv_cache_memory_bytes=16 << 20, seed=0)
    args.update(kw)
    return LLM(**args)


def close(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def vllm_run(llm, prompts, n):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def measure_vllm(llm, prompts, n, repeats):
    vllm_run(llm, prompts, n)  # warm-up: first-call kernel set-up
    ttft = best_of(lambda: vllm_run(llm, prompts, 1), repeats)
    total = best_of(lambda: vllm_run(llm, prompts, n), repeats)
    return ttft, len(prompts) * n / total


def measure_hf(path, prompts, n, repeats):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])  # left padding with <pad>
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()

    def run(k):
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False)

    run(n)
    ttft = best_of(lambda: run(1), repeats)
    total = best_of(lambda: run(n), repeats)
    return ttft, len(prompts) * n / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and one repeat")
    ap.add_argument("--out", default="benchmarks/results/vllm.json")
    args = ap.parse_args()
    import mindspore as ms
    import ms_models
    import torch

    ms.set_device("CPU")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    n_new, repeats = (8, 1) if args.quick else (16, 2)
    root = tempfile.mkdtemp(prefix="bench-vllm-")
    llama = ms_models.make_tiny("llama", os.path.join(root, "llama"), seed=0)
    dsv3 = ms_models.make_tiny("deepseek_v3", os.path.join(root, "dsv3"), seed=0)
    prompts = prompts_for(4, 24, 0)
    rows = []

    # 1. plugin vs HF transformers generate, same model and prompts
    llm = vllm_engine(llama, enable_prefix_caching=False)
    v_ttft, v_tps = measure_vllm(llm, prompts, n_new, repeats)
    close(llm)
    h_ttft, h_tps = measure_hf(llama, prompts, n_new, repeats)
    rows.append(
        dict(
            case="llama: ms-vllm vs HF generate",
            ours=f"{v_tps:.1f} tok/s, TTFT {v_ttft * 1e3:.0f} ms",
            baseline=f"{h_tps:.1f} tok/s, TTFT {h_ttft * 1e3:.0f} ms",
            ratio=round(v_tps / h_tps, 3),
            ours_tok_s=round(v_tps, 2),
            ours_ttft_ms=round(v_ttft * 1e3, 1),
            hf_tok_s=round(h_tps, 2),
            hf_ttft_ms=round(h_ttft * 1e3, 1),
        )
    )

    # 2. prefix caching on shared-prefix prompts (the prefix is cached by a first request)
    shared = prompts_for(1, 96, 1)[0]
    batch = prompts_for(4, 8, 2, prefix=shared)
    times = {}
    for on in (True, False):
        llm = vllm_engine(llama, enable_prefix_caching=on)
        vllm_run(llm, [shared + [5]], 1)
        times[on] = best_of(lambda llm=llm: vllm_run(llm, batch, 2), repeats)
        close(llm)
    rows.append(
        dict(
            case="prefix caching, 96-token shared prefix",
            ours=f"{times[True]:.2f} s",
            baseline=f"{times[False]:.2f} s (off)",
            ratio=round(times[False] / times[True], 3),
        )
    )

    # 3. multi-step decoding (decode-heavy)
    decode = prompts_for(2, 8, 3)
    times = {}
    for steps in (1, 4):
        llm = vllm_engine(llama, additional_config={"multi_step": steps})
        vllm_run(llm, decode, 4)
        times[steps] = best_of(lambda llm=llm: vllm_run(llm, decode, 2 * n_new), repeats)
        close(llm)
    rows.append(
        dict(
            case="multi-step 4 vs 1 (llama decode)",
            ours=f"{times[4]:.2f} s",
            baseline=f"{times[1]:.2f} s",
            ratio=round(times[1] / times[4], 3),
        )
    )

    # 4. MTP speculative decoding on DeepSeek-V3 (random tiny weights: the draft is rarely right)
    times, rate = {}, None
    for mtp in (False, True):
        kw = dict(speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1}) if mtp else {}
        llm = vllm_engine(dsv3, **kw)
        vllm_run(llm, decode, 2)
        times[mtp] = best_of(lambda llm=llm: vllm_run(llm, decode, n_new), repeats)
        if mtp:
            stats = llm.collective_rpc("ms_vllm_stats")[0]
            rate = stats["accepted"] / max(stats["drafts"], 1)
        close(llm)
    rows.append(
        dict(
            case="MTP k=1 vs none (deepseek_v3)",
            ours=f"{times[True]:.2f} s, acceptance {rate:.2f}",
            baseline=f"{times[False]:.2f} s",
            ratio=round(times[False] / times[True], 3),
            acceptance_rate=round(rate, 3),
        )
    )

    result = dict(
        benchmark="vllm",
        title="ms-vllm (vLLM 0.33 + MindSpore CPU) vs HF transformers generate; serving-feature speedups",
        machine=dict(
            platform=platform.platform(),
            cpus=os.cpu_count(),
            python=platform.python_version(),
            torch=torch.__version__,
            mindspore=ms.__version__,
            load_average=os.getloadavg()[0],
        ),
        rows=rows,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(args.out + ".tmp", args.out)
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=result["title"])
        for col in ("case", "ours", "baseline", "ratio"):
            table.add_column(col)
        for r in rows:
            table.add_row(r["case"], r["ours"], r["baseline"], f"{r['ratio']:.2f}x")
        Console().print(table)
    except ImportError:
        for r in rows:
            print(f"{r['case']:<40} {r['ours']:<36} {r['baseline']:<32} {r['ratio']:.2f}x")


if __name__ == "__main__":
    main()
