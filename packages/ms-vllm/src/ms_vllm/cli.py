"""`ms-vllm quantize SRC DST --method ms_w8a8|ms_w4a16`: a quantized HF directory for the plugin."""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_PROMPTS = (
    "Paged attention keeps the cache in fixed-size blocks listed in a block table for every sequence.",
    "A mixture of experts sends each token to a few experts chosen by a router, plus shared experts.",
    "The quick brown fox jumps over the lazy dog. Hello world! 0123456789",
)


def _prompts(src: str, path: str | None) -> list[list[int]]:
    from tokenizers import Tokenizer

    texts = DEFAULT_PROMPTS
    if path:
        with open(path) as f:
            texts = [line.strip() for line in f if line.strip()]
    tokenizer = Tokenizer.from_file(f"{src}/tokenizer.json")
    return [tokenizer.encode(t).ids for t in texts]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ms-vllm", description="ms-vllm tools")
    sub = ap.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize", help="quantize a float HF checkpoint (W8A8 static or W4A16)")
    q.add_argument("src", help="float HF directory (config.json, *.safetensors, tokenizer.json)")
    q.add_argument("dst", help="output directory (written atomically)")
    q.add_argument("--method", choices=["ms_w8a8", "ms_w4a16"], required=True)
    q.add_argument("--calib", help="text file, one calibration prompt per line (default: built-in prompts)")
    q.add_argument("--group-size", type=int, default=32, help="W4A16 group size along the input dim")
    q.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)

    import mindspore as ms

    from .quant import QuantError, quantize_checkpoint

    ms.set_device("CPU")
    try:
        summary = quantize_checkpoint(args.src, args.dst, args.method, _prompts(args.src, args.calib), args.group_size)
    except (QuantError, OSError) as exc:
        print(f"ms-vllm quantize: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"{summary['method']}: {summary['layers']} layers, weights {summary['float_bytes']} -> "
            f"{summary['quantized_bytes']} bytes; written to {args.dst}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
