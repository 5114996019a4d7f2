"""Forward+backward throughput of the ms-models tiny configs: PyNative vs mindspore.jit, side by
side in one run, with Hugging Face transformers on CPU torch (eager) as the peer.

    python benchmarks/bench_models.py [--quick] [--out benchmarks/results/models.json]

Each step is a next-token cross-entropy loss and the gradients of every trainable weight
(`mindspore.value_and_grad`); the jit column compiles that whole function with `mindspore.jit`.
The three are timed in rotation, step by step, and rows report the best step after warm-up (the
machine is shared, so the minimum is the least noisy figure; the first jit call compiles and is
reported separately). MoE layers run the "dense" expert path, the one that compiles.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import machine_info, package_version, print_table, write_result

ARCHS = ("llama", "qwen2", "deepseek_v3")


def _mindspore_step(model, jit: bool):
    import mindspore as ms
    from mindspore import ops

    params = model.trainable_params()  # outside the jit function: trainable_params() cannot be traced

    def loss_fn(ids, labels):
        logits = model(ids)
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    step = ms.value_and_grad(loss_fn, None, params)
    return ms.jit(step) if jit else step


def _interleaved(fns: dict, warmup: int, reps: int) -> tuple[dict, dict]:
    """First-call seconds and best (minimum) seconds of each function, timed in rotation so that
    load from other processes on the machine hits every column alike; the minimum is the figure
    least distorted by that load."""
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
    return first, {name: float(np.min(t)) for name, t in times.items()}


def _mindspore_run(model, ids: np.ndarray, labels: np.ndarray, jit: bool):
    import mindspore as ms

    step = _mindspore_step(model, jit)
    ids_t, labels_t = ms.Tensor(ids), ms.Tensor(labels)

    def run():
        loss, grads = step(ids_t, labels_t)
        loss.asnumpy()  # sync: PyNative runs asynchronously
        grads[-1].asnumpy()

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


def _rows(batch: int, seq: int, warmup: int, reps: int) -> list[dict]:
    import mindspore as ms

    from ms_models import from_pretrained, make_tiny

    ms.set_device("CPU")
    tokens = batch * seq
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for arch in ARCHS:
            path = make_tiny(arch, os.path.join(root, arch), seed=0)
            rng = np.random.default_rng(0)
            ids = rng.integers(4, 320, size=(batch, seq + 1)).astype(np.int32)
            ids, labels = ids[:, :-1].copy(), ids[:, 1:].copy()
            model = from_pretrained(path)
            fns = {
                "pynative": _mindspore_run(model, ids, labels, False),
                "jit": _mindspore_run(model, ids, labels, True),
            }
            if package_version("torch") and package_version("transformers"):
                fns["torch"] = _torch_run(path, ids, labels)
            first, best = _interleaved(fns, warmup, reps)
            row = {
                "model": arch,
                "params": model.num_params(),
                "tokens": tokens,
                "pynative_tok_s": round(tokens / best["pynative"], 1),
                "jit_tok_s": round(tokens / best["jit"], 1),
                "jit/pynative": round(best["pynative"] / best["jit"], 2),
                "jit_first_call_s": round(first["jit"], 2),
                "torch_eager_tok_s": None,
                "jit/torch": None,
            }
            if "torch" in best:
                row["torch_eager_tok_s"] = round(tokens / best["torch"], 1)
                row["jit/torch"] = round(best["torch"] / best["jit"], 2)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short sequences, few repetitions (smoke test)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/models.json"))
    args = parser.parse_args(argv)
    batch, seq, warmup, reps = (2, 32, 2, 3) if args.quick else (4, 64, 2, 6)

    start = time.perf_counter()
    rows = _rows(batch, seq, warmup, reps)
    title = f"models: forward+backward tokens/s, batch {batch} x seq {seq}, float32 CPU"
    print_table(rows, title)
    result = {
        "benchmark": "models",
        "title": f"tiny configs, forward+backward tokens/s (batch {batch} x seq {seq}): PyNative vs mindspore.jit, "
        "HF transformers on torch as the peer",
        "machine": machine_info("mindspore", "torch", "transformers"),
        "quick": args.quick,
        "wall_s": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
