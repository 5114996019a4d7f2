"""ms-vllm on CPU: the vLLM plugin (MindSpore) against Hugging Face transformers generate (torch),
and the speedups of prefix caching, multi-step decoding and MTP, all measured side by side in one run.

    python benchmarks/bench_vllm.py [--quick] --out benchmarks/results/vllm.json
    python benchmarks/bench_vllm.py --model tiny|mid --out F      (the offline comparison; nox -s bench
                                                                  writes results/vllm_tiny.json, vllm_mid.json)
    python benchmarks/bench_vllm.py --serve tiny|mid --out F      (`vllm serve` under `vllm bench serve`;
                                                                  results/vllm_serve_tiny.json, _mid.json)
    python benchmarks/bench_vllm.py --serve dp-ep --out F         (DeepSeek-V3 DP2+EP2 vs TP2 under
                                                                  `vllm bench serve`; results/vllm_dp_ep.json)

The offline comparison (_vllm_offline.py): 64 mixed-length requests through vllm.LLM with compiled
steps against HF generate at its best batch size and thread count, and against the plugin's eager
path; the result's top-level `summary` holds ms_vllm_over_hf (tokens/s, wall), ms_vllm_over_hf_cpu
(per CPU-second), over_eager and outside_model_share (of the run's wall time, outside model calls).
The serving run (_vllm_serve.py): `vllm serve` with the plugin, loaded by vLLM's own `vllm bench serve`
(random dataset, mixed lengths, a request rate and a concurrency cap): throughput and TTFT / TPOT
p50 / p99, after a cold and a warm (compile-cached) start. The feature rows below run the plugin
eagerly (enforce_eager), comparing each feature on and off.

Same checkpoints (ms_models.make_tiny; a "small" 4-layer, 256-wide Llama for prefix caching, where
prefill compute is not lost in per-step overhead) and token prompts for both stacks, greedy decoding.
Each figure is the best of the repeats after a warm-up. Both stacks run in this one process (vLLM's
engine core in-process), so besides wall time each case records the process CPU time; the ratios
use CPU time, which stays meaningful when the shared 2-core box is oversubscribed (wall time then
mostly measures waiting). Quantization rows: max logits error and perplexity against the float
model on held-out text, and the stored weight bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np
from _common import machine_info, write_result
from _vllm_dp_ep import dp_ep, dp_ep_rows
from _vllm_offline import offline, rows_of
from _vllm_serve import serve, serve_rows
from _vllm_trained import trained_rows


def best_of(fn, repeats):
    """(wall seconds, process CPU seconds) of the fastest of `repeats` runs (by CPU time)."""
    best = None
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fn()
        run = (time.perf_counter() - t, time.process_time() - c)
        best = run if best is None or run[1] < best[1] else best
    return best


def prompts_for(n, length, seed, prefix=()):
    rng = np.random.default_rng(seed)
    return [list(prefix) + rng.integers(4, 320, length).tolist() for _ in range(n)]


def vllm_engine(path, **kw):
    from vllm import LLM

    args = dict(
        model=path, max_model_len=256, block_size=16, kv_cache_memory_bytes=16 << 20, seed=0, enforce_eager=True
    )
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
    return ttft, [len(prompts) * n / t for t in total]


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
    return ttft, [len(prompts) * n / t for t in total]


def timing_row(case, ours, base, base_label=""):
    """A row comparing two (wall, cpu) timings of the same work; ratio = base / ours on CPU time."""
    return dict(
        case=case,
        ours=f"{ours[1]:.2f} s CPU ({ours[0]:.1f} s wall)",
        baseline=f"{base[1]:.2f} s CPU ({base[0]:.1f} s wall){base_label}",
        ratio=round(base[1] / ours[1], 3),
        ours_cpu_s=round(ours[1], 3),
        ours_wall_s=round(ours[0], 3),
        baseline_cpu_s=round(base[1], 3),
        baseline_wall_s=round(base[0], 3),
    )


def quant_rows(path, root, held_out=None, label=""):
    """Logits error, perplexity and weight bytes of W8A8 and W4A16 against the float model, over
    `held_out` token sequences (default: one sentence of the tokenizer's corpus)."""
    import mindspore as ms
    from tokenizers import Tokenizer

    import ms_models
    from ms_vllm.cli import DEFAULT_PROMPTS
    from ms_vllm.quant import load_quantized, quantize_checkpoint, weight_bytes

    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    calib = [tok.encode(t).ids for t in DEFAULT_PROMPTS]
    if held_out is None:
        held_out = [tok.encode("Grouped-query attention shares one key and value head among several query heads.").ids]
    name = f"quant ({label})" if label else "quant"

    def evaluate(model):
        logits = model(ms.Tensor(np.asarray(held_out, np.int32))).asnumpy().astype(np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        targets = np.asarray(held_out)[:, 1:]
        nll = -np.take_along_axis(logp[:, :-1], targets[..., None], -1).mean()
        return logits, float(np.exp(nll))

    base = ms_models.from_pretrained(path)
    ref, ppl = evaluate(base)
    rows = [dict(case=f"{name}: float32", ours=f"ppl {ppl:.2f}, {weight_bytes(base)} B", baseline="-", ratio=1.0)]
    for method in ("ms_w8a8", "ms_w4a16"):
        dst = os.path.join(root, method)
        quantize_checkpoint(path, dst, method, calib, group_size=32)
        model = load_quantized(dst, method)
        logits, qppl = evaluate(model)
        err = float(np.abs(logits - ref).max() / np.abs(ref).max())
        rows.append(
            dict(
                case=f"{name}: {method}",
                ours=f"ppl {qppl:.2f} ({(qppl / ppl - 1) * 100:+.1f}%), logits err {err:.3f}, {weight_bytes(model)} B",
                baseline=f"ppl {ppl:.2f}, {weight_bytes(base)} B",
                ratio=round(weight_bytes(base) / weight_bytes(model), 3),
                logits_max_rel_err=round(err, 4),
                perplexity=round(qppl, 3),
                perplexity_float=round(ppl, 3),
                weight_bytes=weight_bytes(model),
                weight_bytes_float=weight_bytes(base),
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and one repeat")
    ap.add_argument("--out", default="benchmarks/results/vllm.json")
    ap.add_argument("--model", choices=("tiny", "mid"), help="only the offline comparison on this model")
    ap.add_argument(
        "--serve", choices=("tiny", "mid", "dp-ep"),
        help="only `vllm serve` under `vllm bench serve`: this llama, or DeepSeek-V3 DP2+EP2 vs TP2",
    )  # fmt: skip
    ap.add_argument("--trained", action="store_true", help="only the trained DeepSeek-V3 rows (MTP, quantization)")
    ap.add_argument("--trained-dir", help="train the DeepSeek-V3 there, or reuse it if it holds training.json")
    args = ap.parse_args()
    if args.serve == "dp-ep":
        result = dp_ep(tempfile.mkdtemp(prefix="bench-vllm-dpep-"), num_prompts=16 if args.quick else 64)
        return write_dp_ep(args, result)
    if args.serve:
        result = serve(args.serve, tempfile.mkdtemp(prefix="bench-vllm-serve-"), num_prompts=16 if args.quick else 64)
        return write_serve(args, result)
    import mindspore as ms
    import torch

    import ms_models

    ms.set_device("CPU")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    n_new, repeats = (8, 1) if args.quick else (16, 2)
    root = tempfile.mkdtemp(prefix="bench-vllm-")
    llama = ms_models.make_tiny("llama", os.path.join(root, "llama"), seed=0)
    dsv3 = ms_models.make_tiny("deepseek_v3", os.path.join(root, "dsv3"), seed=0)
    small = ms_models.make_tiny(
        "llama",
        os.path.join(root, "small"),
        seed=0,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=512,
    )
    prompts = prompts_for(4, 24, 0)
    rows = []
    helpers = SimpleNamespace(
        vllm_engine=vllm_engine, vllm_run=vllm_run, best_of=best_of, timing_row=timing_row, quant_rows=quant_rows,
        close=close,
    )  # fmt: skip
    if args.trained:
        trained, summary = trained_rows(root, args.quick, helpers, args.trained_dir)
        return write(args, trained, {}, None, summary)
    if args.model:
        result = offline(args.model, root, repeats=1 if args.quick else 2)
        return write(args, rows_of(result), {args.model: result}, args.model)

    # 1. plugin (eager) vs HF transformers generate, same model and prompts
    llm = vllm_engine(llama, enable_prefix_caching=False)
    v_ttft, v_tps = measure_vllm(llm, prompts, n_new, repeats)
    close(llm)
    h_ttft, h_tps = measure_hf(llama, prompts, n_new, repeats)
    rows.append(
        dict(
            case="llama: ms-vllm eager vs HF generate (4 prompts)",
            ours=f"{v_tps[1]:.1f} tok/CPU-s ({v_tps[0]:.1f} tok/s wall), TTFT {v_ttft[1] * 1e3:.0f} ms CPU",
            baseline=f"{h_tps[1]:.1f} tok/CPU-s ({h_tps[0]:.1f} tok/s wall), TTFT {h_ttft[1] * 1e3:.0f} ms CPU",
            ratio=round(v_tps[1] / h_tps[1], 3),
            ours_tok_per_cpu_s=round(v_tps[1], 2),
            ours_tok_s_wall=round(v_tps[0], 2),
            ours_ttft_cpu_ms=round(v_ttft[1] * 1e3, 1),
            ours_ttft_wall_ms=round(v_ttft[0] * 1e3, 1),
            hf_tok_per_cpu_s=round(h_tps[1], 2),
            hf_tok_s_wall=round(h_tps[0], 2),
            hf_ttft_cpu_ms=round(h_ttft[1] * 1e3, 1),
            hf_ttft_wall_ms=round(h_ttft[0] * 1e3, 1),
        )
    )

    # 2. prefix caching on shared-prefix prompts (the prefix is cached by a first request)
    shared = prompts_for(1, 192, 1)[0]
    batch = prompts_for(4, 8, 2, prefix=shared)
    times = {}
    for on in (True, False):
        llm = vllm_engine(small, enable_prefix_caching=on, max_model_len=512, kv_cache_memory_bytes=64 << 20)
        vllm_run(llm, [shared + [5]], 1)
        times[on] = best_of(lambda llm=llm: vllm_run(llm, batch, 2), repeats)
        close(llm)
    rows.append(timing_row("prefix caching on vs off, 192-token prefix (small llama)", times[True], times[False]))

    # 3. multi-step decoding (decode-heavy)
    decode = prompts_for(2, 8, 3)
    times = {}
    for steps in (1, 4):
        llm = vllm_engine(llama, additional_config={"multi_step": steps})
        vllm_run(llm, decode, 4)
        times[steps] = best_of(lambda llm=llm: vllm_run(llm, decode, 2 * n_new), repeats)
        close(llm)
    rows.append(timing_row("multi-step 4 vs 1 (llama, decode-heavy)", times[4], times[1]))

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
    row = timing_row(f"MTP k=1 vs none (deepseek_v3, acceptance {rate:.2f})", times[True], times[False])
    rows.append(dict(row, acceptance_rate=round(rate, 3)))
    # ... and compiled: verification steps in verify buckets, the MTP module in its own graphs
    few = {"compile": {"decode_sizes": [1, 2], "prefill_sizes": [16], "context_sizes": [256], "batch_tokens": 0}}
    compiled = {}
    for mtp in (False, True):
        kw = dict(speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1}) if mtp else {}
        llm = vllm_engine(dsv3, enforce_eager=False, additional_config=few, **kw)
        vllm_run(llm, decode, 2)
        compiled[mtp] = best_of(lambda llm=llm: vllm_run(llm, decode, n_new), repeats)
        stats = llm.collective_rpc("ms_vllm_stats")[0]
        close(llm)
    row = timing_row("MTP k=1 vs none, compiled (deepseek_v3)", compiled[True], compiled[False])
    rows.append(dict(row, eager_calls=stats["eager_calls"], draft_eager_calls=stats.get("draft_eager_calls")))
    rows.append(timing_row("MTP k=1 compiled vs eager (deepseek_v3)", compiled[True], times[True]))

    # 5. quantization (no engine: logits and perplexity of the MindSpore models themselves)
    rows += quant_rows(small, root)

    # 6. a trained tiny DeepSeek-V3: MTP acceptance and speed, quantized perplexity (_vllm_trained.py)
    trained, summary = trained_rows(root, args.quick, helpers, args.trained_dir)
    rows += trained
    named = {"prefix caching": "prefix_caching_speedup", "multi-step 4": "multi_step_4_over_1_speedup"}
    named.update({"MTP k=1 vs none, compiled": "random_mtp_over_none_speedup_compiled"})
    for r in rows:
        for start, key in named.items():
            if r["case"].startswith(start):
                summary[key] = r["ratio"]
    write(args, rows, {}, None, summary)


def write_serve(args, result) -> None:
    m = result["model"]
    report = dict(
        benchmark=f"vllm_serve_{m}",
        title=f"ms-vllm compiled, `vllm serve` under `vllm bench serve` ({m} llama): throughput, TTFT, TPOT",
        summary=result["summary"],
        machine=machine_info("mindspore", "torch", "vllm", quick=args.quick),
        load=result["load"],
        script="bench_vllm.py",
        note=f"Written by `benchmarks/bench_vllm.py --serve {m}`.",
        rows=serve_rows(result),
        raw=result["raw"],
    )
    write_result(Path(args.out), report)
    print(json.dumps(report["summary"], indent=2))


def write_dp_ep(args, result) -> None:
    report = dict(
        benchmark="vllm_dp_ep",
        title="ms-vllm DeepSeek-V3 (hidden 256) on 2 processes: DP2+EP2 (all-to-all) vs TP2, `vllm bench serve`",
        summary=result["summary"],
        machine=machine_info("mindspore", "torch", "vllm", quick=args.quick),
        load=result["load"],
        model=result["model"],
        script="bench_vllm.py",
        note="Written by `benchmarks/bench_vllm.py --serve dp-ep`; variants alternated, best of the rounds.",
        rows=dp_ep_rows(result),
        runs=result["runs"],
        raw=result["raw"],
    )
    write_result(Path(args.out), report)
    print(json.dumps(report["summary"], indent=2))


def write(args, rows, offline_results, headline, summary=None) -> None:
    title = "ms-vllm (vLLM 0.33 + MindSpore CPU) vs HF transformers generate; serving-feature speedups"
    if headline:
        title = f"ms-vllm compiled, offline 64 mixed-length requests ({headline} llama) vs HF generate and eager"
    result = dict(
        benchmark=f"vllm_{headline}" if headline else "vllm",
        title=title,
        machine=machine_info("mindspore", "torch", "vllm", "transformers", quick=args.quick),
        rows=rows,
    )
    if summary is not None:
        result["summary"] = summary
    if headline:
        off = offline_results[headline]
        result["script"] = "bench_vllm.py"
        result["note"] = f"Written by `benchmarks/bench_vllm.py --model {headline}` (the offline comparison)."
        result["summary"] = off["summary"]
        result["summary_rows"] = [off["summary"]]
        result["compile_rows"] = [dict(bucket=k, compile_s=v) for k, v in off["compile_s"].items()]
        result["hf_rows"] = off["hf"]
        result["offline"] = off
    write_result(Path(args.out), result)
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
