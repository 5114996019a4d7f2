"""Console script `ms-models`: make-tiny, train-tiny, info."""

from __future__ import annotations

import argparse
import json
import sys

from ms_layout.console import run_console

from .errors import ModelError


def _make_tiny(args: argparse.Namespace) -> dict:
    from .tiny import make_tiny

    path = make_tiny(args.arch, args.path, seed=args.seed)
    return {"arch": args.arch, "path": path, "seed": args.seed}


def _train_tiny(args: argparse.Namespace) -> dict:
    from .train_tiny import train_tiny

    overrides = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ModelError(f"--set {item!r}; expected FIELD=VALUE (a JSON value), e.g. hidden_size=256")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            raise ModelError(f"--set {item!r}: {value!r} is not a JSON value") from None
    report = train_tiny(args.arch, args.path, steps=args.steps, seed=args.seed, **overrides)
    report["path"] = args.path
    report.pop("losses")
    return report


def _info(args: argparse.Namespace) -> dict:
    from .config import load_config
    from .io import read_safetensors

    config = load_config(args.path)
    tensors = read_safetensors(args.path)
    return {
        "model_type": config.model_type,
        "num_tensors": len(tensors),
        "num_params": int(sum(t.size for t in tensors.values())),
        "config": config.to_dict(),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ms-models", description="Reference MindSpore decoder models")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("make-tiny", help="write a tiny random HF checkpoint with a tokenizer")
    tiny.add_argument("arch", choices=["llama", "qwen2", "deepseek_v3"])
    tiny.add_argument("path")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--json", action="store_true", help="print the result as JSON")
    tiny.set_defaults(func=_make_tiny)
    train = sub.add_parser("train-tiny", help="train a tiny model on a synthetic corpus and write it (minutes)")
    train.add_argument("arch", choices=["llama", "qwen2", "deepseek_v3"])
    train.add_argument("path")
    train.add_argument("--steps", type=int, default=600)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--set", action="append", metavar="FIELD=VALUE", help="a config field, e.g. hidden_size=256")
    train.add_argument("--json", action="store_true", help="print the result as JSON")
    train.set_defaults(func=_train_tiny)
    info = sub.add_parser("info", help="describe an HF checkpoint directory")
    info.add_argument("path")
    info.add_argument("--json", action="store_true", help="print the result as JSON")
    info.set_defaults(func=_info)
    return parser


def _run(args: argparse.Namespace) -> None:
    result = args.func(args)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        for key, value in result.items():
            if key != "config":
                print(f"{key}: {value}")


def main(argv: list[str] | None = None) -> int:
    """Entry point; bad input is one line on stderr and exit code 2 (--debug shows the traceback)."""
    return run_console("ms-models", build_parser(), _run, argv, (ModelError,))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
