"""Forward+backward throughput of ms-models: PyNative, ``mindspore.jit`` and the compiled explicit
passes, side by side in one run with Hugging Face transformers on CPU torch (eager) as the peer.

    python benchmarks/bench_models.py [--size compute|tiny|both] [--threads 1] [--quick]
        [--out benchmarks/results/models.json]

One training step is the next-token cross-entropy of a batch and the gradient of every trainable
weight. Four ways to take it, timed in rotation step by step on the same process and cores:

* ``pynative``: ``mindspore.value_and_grad`` of the model, op by op (the debug path);
* ``jit``: the same function compiled whole with ``mindspore.jit``;
* ``passes``: ms-models' explicit passes as ms-pipeline's training stage runs them (one stage
  holding every block: a compiled forward keeping what the backward needs, then one compiled
  backward giving the input and weight gradients, accumulated in numpy), with the fused CPU
  kernels of ``ms_models.fused`` where they are on (one thread per process: here);
* ``passes_plain``: the same passes on MindSpore's own ops only (the fused kernels off);
* ``torch``: the same checkpoint in HF transformers, eager torch, ``loss.backward()``.

Two model sizes: ``compute`` (the headline: hidden 256, 4 layers, vocabulary 2048, batch 4 x 128
tokens, where the GEMMs and not the per-op dispatch take the time) and ``tiny`` (the 64-wide test
configs, 256 tokens: dispatch-bound, kept to show what per-call overhead costs). Every framework
runs on the same ``--threads`` cores (the process pinned to them). Rows report the median step
after warm-up; the first jit call (compilation) is reported apart. The JSON's ``summary`` holds
the jit and passes throughput over torch's, the worst dense model and DeepSeek-V3 apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import machine_info, package_version, print_table, write_result

ARCHS = ("llama", "qwen2", "deepseek_v3")
DENSE = ("llama", "qwen2")

# compute-bound sizes: the GEMMs of a step dominate its per-op overhead (hidden >= 256)
COMPUTE = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, max_position_embeddings=256
)
COMPUTE_ARCH = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),  # as Qwen2-7B
    "deepseek_v3": dict(
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        moe_intermediate_size=128,
        first_k_dense_replace=1,
    ),
}
SHAPES = {"compute": (4, 128), "tiny": (4, 64)}  # batch x tokens per size
VARIANTS = ("pynative", "jit", "passes", "passes_plain")
QUICK_SHAPES = {"compute": (2, 64), "tiny": (2, 32)}


def _mindspore_step(model, jit: bool):
    import mindspore as ms
    from mindspore import ops

    params = model.trainable_params()  # outside the jit function: trainable_params() cannot be traced

    def loss_fn(ids, labels):
        logits = model(ids)
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    step = ms.value_and_grad(loss_fn, None, params)
    return ms.jit(step) if jit else step


def _mindspore_run(model, ids: np.ndarray, labels: np.ndarray, jit: bool):
    import mindspore as ms

    step = _mindspore_step(model, jit)
    ids_t, labels_t = ms.Tensor(ids), ms.Tensor(labels)

    def run():
        loss, grads = step(ids_t, labels_t)
        # wait on the output the graph computes last, the embedding's gradient (the end of the
        # backward): reading an earlier one (the loss) first returns while the graph still runs,
        # and the next read busy-waits the Python thread on the kernels' core (measured here: 4x
        # the step; docs/mindspore-cpu.md section 15)
        grads[0].asnumpy()
        loss.asnumpy()

    return run


def _passes_run(model, ids: np.ndarray, labels: np.ndarray, fused: bool | None = None):
    """The step on the explicit passes, as one pipeline stage holding every block runs it;
    ``fused``: the fused CPU kernels on, off, or as ms_models decides (None)."""
    import mindspore as ms

    import ms_models
    from ms_models import fused as kernels
    from ms_pipeline.runtime import Stage

    kernels.enable(fused)  # read when the stage's graphs compile: on the first call, below
    stage = Stage(0, ms_models.pipeline_blocks(model), first=True, last=True, jit=True)
    ids_t, labels_t, one = ms.Tensor(ids), ms.Tensor(labels), ms.Tensor(1.0, ms.float32)

    def run():
        stage.zero_grads()
        stage.forward(0, ids_t, labels_t).asnumpy()
        stage.backward_full(0, one)

    start = time.perf_counter()
    run()
    run.first_call_s = time.perf_counter() - start
    kernels.enable(None)
    return run


def _torch_run(path: str, ids: np.ndarray, labels: np.ndarray):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype="float32")
    ids_t, labels_t = torch.from_numpy(ids).long(), torch.from_numpy(labels).long()

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(ids_t).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels_t.reshape(-1))
        loss.backward()

    return run


def _interleaved(fns: dict, warmup: int, reps: int) -> tuple[dict, dict]:
    """First-call seconds and the median step seconds of each function after ``warmup`` calls,
    timed in rotation so that whatever else the machine does hits every column alike."""
    first, times = {}, {name: [] for name in fns}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - start
        for _ in range(warmup - 1):
            fn()
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return first, {name: statistics.median(t) for name, t in times.items()}


def _overrides(size: str, arch: str) -> dict:
    return {**COMPUTE, **COMPUTE_ARCH[arch]} if size == "compute" else {}


def _rows(size: str, batch: int, seq: int, warmup: int, reps: int) -> list[dict]:
    from ms_models import from_pretrained, make_tiny

    tokens = batch * seq
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for arch in ARCHS:
            overrides = _overrides(size, arch)
            path = make_tiny(arch, os.path.join(root, arch), seed=0, **overrides)
            vocab = overrides.get("vocab_size", 320)
            ids = np.random.default_rng(0).integers(4, vocab, size=(batch, seq + 1)).astype(np.int32)
            ids, labels = ids[:, :-1].copy(), ids[:, 1:].copy()
            model = from_pretrained(path)
            fns = {
                "pynative": _mindspore_run(model, ids, labels, False),
                "jit": _mindspore_run(model, ids, labels, True),
            }
            if not model.config.tie_word_embeddings:  # a tied head is one weight in two blocks
                fns["passes"] = _passes_run(model, ids, labels)
                fns["passes_plain"] = _passes_run(model, ids, labels, fused=False)
            if package_version("torch") and package_version("transformers"):
                fns["torch"] = _torch_run(path, ids, labels)
            first, step = _interleaved(fns, warmup, reps)
            row = {
                "size": size,
                "model": arch,
                "family": "dense" if arch in DENSE else "moe",
                "params": model.num_params(),
                "tokens": tokens,
                **{f"{name}_tok_s": _rate(tokens, step.get(name)) for name in VARIANTS},
                "jit/pynative": round(step["pynative"] / step["jit"], 2),
                "jit_first_call_s": round(first["jit"], 2),
                "passes_first_call_s": round(fns["passes"].first_call_s, 2) if "passes" in fns else None,
                "fused/plain": round(step["passes_plain"] / step["passes"], 3) if "passes" in step else None,
                "torch_eager_tok_s": None,
                "jit/torch": None,
                "passes/torch": None,
                "passes_plain/torch": None,
            }
            if "torch" in step:
                row["torch_eager_tok_s"] = round(tokens / step["torch"], 1)
                row["jit/torch"] = round(step["torch"] / step["jit"], 3)
                if "passes" in step:
                    row["passes/torch"] = round(step["torch"] / step["passes"], 3)
                    row["passes_plain/torch"] = round(step["torch"] / step["passes_plain"], 3)
            rows.append(row)
    return rows


def _rate(tokens: int, seconds: float | None) -> float | None:
    return None if seconds is None else round(tokens / seconds, 1)


def _summary(rows: list[dict]) -> dict:
    """Throughput ratios to torch eager at the compute-bound size (the worst dense model, and
    DeepSeek-V3), and jit over PyNative at every size."""
    out: dict = {"jit_over_pynative_min": min(r["jit/pynative"] for r in rows)}
    compute = [r for r in rows if r["size"] == "compute"]
    columns = (
        ("jit/torch", "jit_over_torch"),
        ("passes/torch", "passes_over_torch"),
        ("passes_plain/torch", "passes_plain_over_torch"),
    )
    for column, key in columns:
        dense = [r[column] for r in compute if r["model"] in DENSE and r[column] is not None]
        if dense:
            out[f"{key}_dense_min"] = min(dense)
        out.update({f"{key}_deepseek_v3": r[column] for r in compute if r["model"] == "deepseek_v3" and r[column]})
    return out


def _fused_state() -> str:
    """Whether ms_models' fused CPU kernels are on by default here, or why not."""
    from ms_models import fused

    return "on" if fused.refresh() else f"off: {fused.why_not()}"


def _avx512() -> bool | None:
    """Whether the CPU has AVX-512 (MindSpore's CPU kernels are much faster with it), None if unknown."""
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def _pin(threads: int) -> list[int]:
    """Pin the process to its first ``threads`` CPUs and give every framework that many threads."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    os.sched_setaffinity(0, cpus)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE, runtime_num_threads=threads)
    ms.set_device("CPU")
    if package_version("torch"):
        import torch

        torch.set_num_threads(threads)
    return cpus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("compute", "tiny", "both"), default="both")
    parser.add_argument("--threads", type=int, default=1, help="cores for every framework (default 1)")
    parser.add_argument("--quick", action="store_true", help="short sequences, few repetitions (smoke test)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/models.json"))
    args = parser.parse_args(argv)
    if not 1 <= args.threads <= len(os.sched_getaffinity(0)):
        parser.error(f"--threads must be within 1..{len(os.sched_getaffinity(0))}, got {args.threads}")
    cpus = _pin(args.threads)
    warmup, reps = (2, 3) if args.quick else (2, 9)
    sizes = ("compute", "tiny") if args.size == "both" else (args.size,)
    shapes = QUICK_SHAPES if args.quick else SHAPES

    start = time.perf_counter()
    rows = [row for size in sizes for row in _rows(size, *shapes[size], warmup, reps)]
    title = f"models: forward+backward tokens/s, float32 CPU, {args.threads} thread(s) per framework"
    print_table(rows, title)
    summary = _summary(rows)
    print(summary)
    result = {
        "benchmark": "models",
        "title": "forward+backward tokens/s: PyNative, mindspore.jit and the compiled explicit passes, "
        "HF transformers on torch (eager) as the peer; compute-bound and tiny configs",
        "summary": summary,
        "machine": machine_info(
            "mindspore",
            "torch",
            "transformers",
            threads=args.threads,
            cpus=cpus,
            compute_size={**COMPUTE, "batch_x_seq": shapes["compute"]},
            fused_kernels=_fused_state(),
            avx512=_avx512(),
        ),
        "quick": args.quick,
        "wall_s": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
