"""`ms-vllm quantize SRC DST --method ms_w8a8|ms_w4a16`: a quantized HF directory for the plugin."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ms_layout.console import run_console

from .quant_checks import METHODS, QuantError, check_group_size, check_method, check_source, check_target, read_calib

DEFAULT_PROMPTS = (
    "Paged attention keeps the cache in fixed-size blocks listed in a block table for every sequence.",
    "A mixture of experts sends each token to a few experts chosen by a router, plus shared experts.",
    "The quick brown fox jumps over the lazy dog. Hello world! 0123456789",
)


def _prompts(src: str, path: str | None) -> list[list[int]]:
    from tokenizers import Tokenizer

    texts = read_calib(path) if path else DEFAULT_PROMPTS
    tokenizer_file = os.path.join(src, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise QuantError(f"checkpoint folder {src!r} has no tokenizer.json (needed to tokenize the prompts)")
    try:
        tokenizer = Tokenizer.from_file(tokenizer_file)
    except Exception as exc:  # the tokenizers library raises its own exception type for a damaged file
        raise QuantError(f"{tokenizer_file!r} is not a tokenizer file: {str(exc)[:200]}") from None
    return [tokenizer.encode(t).ids for t in texts]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ms-vllm", description="ms-vllm tools")
    sub = ap.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize", help="quantize a float HF checkpoint (W8A8 static or W4A16)")
    q.add_argument("src", help="float HF directory (config.json, *.safetensors, tokenizer.json)")
    q.add_argument("dst", help="output directory (written atomically)")
    q.add_argument("--method", choices=list(METHODS), required=True)
    q.add_argument("--calib", help="text file, one calibration prompt per line (default: built-in prompts)")
    q.add_argument("--group-size", type=int, default=32, help="W4A16 group size along the input dim")
    q.add_argument("--json", action="store_true", help="print the summary as JSON")
    q.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")
    return ap


def _quantize(args: argparse.Namespace) -> int:
    # Everything that can be checked without loading MindSpore first, so a typo is answered at once.
    check_method(args.method)
    check_group_size(args.group_size)
    check_source(args.src)
    check_target(args.src, args.dst)
    prompts = _prompts(args.src, args.calib)

    import mindspore as ms

    from .quant import quantize_checkpoint

    ms.set_device("CPU")
    summary = quantize_checkpoint(args.src, args.dst, args.method, prompts, args.group_size)
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"{summary['method']}: {summary['layers']} layers, weights {summary['float_bytes']} -> "
            f"{summary['quantized_bytes']} bytes; written to {args.dst}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_console("ms-vllm", build_parser(), _quantize, argv, (QuantError,))


if __name__ == "__main__":
    sys.exit(main())
