"""``ms-recompute report``: activation memory of a model, with and without a recompute plan.

    ms-recompute report --config path/to/config.json --batch 1 --seq 4096 --budget 20GiB [--tp 8] [--json]

Reads an HF config.json (Llama, Qwen2 or DeepSeek-V3), counts each layer's activations with the
formula of ``ms_recompute.memory``, plans recompute under the budget and prints both; ``--out`` saves
the plan (msgpack) for ``ms_recompute.runtime.apply_plan``. Needs numpy and msgpack only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from ms_layout.console import run_console
from ms_layout.files import FileError, read_json

from .errors import RecomputeError
from .limits import MAX_PLAN_BYTES
from .memory import Shape, arch_of, megatron_bytes, model_memory
from .plan import Granularity, RecomputePlan
from .planner import METHODS, plan_recompute, predict

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def parse_bytes(text: str) -> int:
    """``20GiB``, ``512MiB``, ``1.5GB`` or a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9]{0,30}\.?[0-9]{1,30})\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise RecomputeError(f"budget {str(text)[:40]!r}: expected a size like 20GiB, 512MiB or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _read_config(path: str, arch: str | None) -> dict:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise RecomputeError(f"no config file at {path!r}")
    try:
        config = read_json(path, "config file", MAX_PLAN_BYTES.value)
    except FileError as exc:
        raise RecomputeError(str(exc)) from None
    if not isinstance(config, dict):
        raise RecomputeError(f"{path!r} holds a {type(config).__name__}, not a config object")
    if arch is not None:
        found = config.get("model_type")
        if found not in (None, arch):
            raise RecomputeError(f"--arch {arch} but {path!r} says model_type {found!r:.50}")
        config = {**config, "model_type": arch}
    arch_of(config)
    return config


def _check_numbers(args: argparse.Namespace) -> None:
    """Flags that would otherwise divide by zero or turn every time into NaN."""
    if not (math.isfinite(args.tflops) and args.tflops > 0):
        raise RecomputeError(f"--tflops {args.tflops}: expected a positive number")
    if not (math.isfinite(args.comm_ms) and args.comm_ms >= 0):
        raise RecomputeError(f"--comm-ms {args.comm_ms}: expected a number >= 0")
    if args.out:
        out = Path(args.out)
        if out.is_dir():
            raise RecomputeError(f"--out {args.out!r} is a folder; give a file name")
        if not out.parent.is_dir():
            raise RecomputeError(f"--out {args.out!r}: folder {str(out.parent)!r} does not exist")


def report(args: argparse.Namespace) -> dict[str, Any]:
    """The numbers the report prints, as a JSON-ready dict."""
    _check_numbers(args)
    config = _read_config(args.config, args.arch)
    shape = Shape(args.batch, args.seq, args.dtype, args.tp)
    layers = model_memory(config, shape, moe_impl=args.moe_impl)
    budget = parse_bytes(args.budget)
    rate = args.tflops * 1e12
    plan = plan_recompute(
        layers, budget, flops_per_s=rate, comm_s=args.comm_ms / 1e3, overlap=args.overlap, method=args.method
    )
    every = RecomputePlan.uniform(len(layers), Granularity.FULL, overlap=args.overlap)
    full = predict(every, layers, flops_per_s=rate, comm_s=args.comm_ms / 1e3)
    kinds = {}
    for m in layers:
        kinds.setdefault(m.kind, m)
    p = plan.prediction
    return {
        "arch": config["model_type"],
        "layers": len(layers),
        "shape": {"batch": shape.batch, "seq": shape.seq, "dtype": shape.dtype, "tp": shape.tp},
        "per_layer": {
            kind: {
                "total_bytes": m.total_bytes,
                "input_bytes": m.input_bytes,
                "constant_bytes": m.constant_bytes,
                "modules": {
                    x.name: {"input_bytes": x.input_bytes, "activation_bytes": x.activation_bytes, "flops": x.flops}
                    for x in m.modules
                },
                "megatron_formula_bytes": megatron_bytes(config, shape),
            }
            for kind, m in kinds.items()
        },
        "without_plan": {"kept_bytes": p.baseline_bytes, "peak_bytes": p.baseline_bytes, "recompute_s": 0.0},
        "full_recompute": {
            "kept_bytes": full.kept_bytes,
            "peak_bytes": full.peak_bytes,
            "recompute_s": full.recompute_s,
        },
        "plan": {
            "spec": plan.spec,
            "method": p.method,
            "budget_bytes": budget,
            "kept_bytes": p.kept_bytes,
            "saved_bytes": p.saved_bytes,
            "working_bytes": p.working_bytes,
            "peak_bytes": p.peak_bytes,
            "recompute_s": p.recompute_s,
            "groups": [str(g) for g in plan.groups],
        },
        "_plan": plan,
    }


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.3f} GiB" if n >= 1 << 28 else f"{n / (1 << 20):.3f} MiB"


def _print(r: dict[str, Any]) -> None:
    s = r["shape"]
    print(f"{r['arch']}: {r['layers']} layers, batch {s['batch']} x seq {s['seq']}, {s['dtype']}, tp {s['tp']}")
    for kind, m in r["per_layer"].items():
        print(
            f"  one {kind} layer keeps {_gib(m['total_bytes'])} (+{_gib(m['constant_bytes'])} mask/expert copies);"
            f" Megatron's fp16 formula says {_gib(m['megatron_formula_bytes'])}"
        )
        for name, x in m["modules"].items():
            print(f"    {name:26s} activations {_gib(x['activation_bytes']):>14s}  input {_gib(x['input_bytes']):>12s}")
    w, f, p = r["without_plan"], r["full_recompute"], r["plan"]
    print(f"  without recompute : kept {_gib(w['kept_bytes'])}")
    print(
        f"  full recompute    : kept {_gib(f['kept_bytes'])}, peak {_gib(f['peak_bytes'])},"
        f" recompute {f['recompute_s'] * 1e3:.2f} ms"
    )
    print(
        f"  plan ({p['method']:6s})   : kept {_gib(p['kept_bytes'])}, peak {_gib(p['peak_bytes'])} <= budget"
        f" {_gib(p['budget_bytes'])}, saves {_gib(p['saved_bytes'])}, recompute {p['recompute_s'] * 1e3:.2f} ms"
    )
    print(f"  plan spec         : {p['spec'] or '(nothing recomputed)'}")
    for g in p["groups"]:
        print(f"    group {g}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ms-recompute", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("report", help="activation memory with and without a recompute plan")
    rp.add_argument("--config", required=True, help="HF config.json, or the directory holding it")
    rp.add_argument("--arch", choices=("llama", "qwen2", "deepseek_v3"), help="model family (default: model_type)")
    rp.add_argument("--budget", required=True, help="peak activation memory per microbatch and rank, e.g. 20GiB")
    rp.add_argument("--batch", type=int, default=1, help="sequences per microbatch")
    rp.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    rp.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    rp.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    rp.add_argument("--tflops", type=float, default=100.0, help="achieved TFLOP/s, to turn FLOPs into time")
    rp.add_argument("--comm-ms", type=float, default=0.0, help="time of one TP all-reduce of a layer, ms")
    rp.add_argument("--overlap", action="store_true", help="pair fully recomputed layers (working set x2)")
    rp.add_argument("--moe-impl", default="dispatch", choices=("dense", "dispatch"), help="MoE expert execution")
    rp.add_argument("--method", default="auto", choices=METHODS)
    rp.add_argument("--out", help="save the plan here (msgpack)")
    rp.add_argument("--json", action="store_true", help="print JSON for machines")
    rp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")
    return parser


def _run(args: argparse.Namespace) -> int:
    result = report(args)
    plan = result.pop("_plan")
    if args.out:
        try:
            plan.save(args.out)
        except OSError as exc:  # name the file asked for, not the temporary one beside it
            raise RecomputeError(f"cannot write --out {args.out!r}: {exc.strerror or exc}") from None
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_console("ms-recompute", build_parser(), _run, argv, (RecomputeError,))


if __name__ == "__main__":
    sys.exit(main())
