"""The `ms-reshard` console script.

ms-reshard plan --src dp=2,tp=2:tp,None --dst tp=4:None,tp --shape 8,8 [--json]
ms-reshard checkpoint SRC_DIR DST_DIR --dst-config tp=4 [--src-config dp=2,tp=2,opt] [--fuse] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Sequence

from ms_layout import LayoutError, ParallelConfig, loads
from ms_layout.console import run_console
from ms_layout.files import FileError, read_capped

from .errors import ReshardError
from .fusion import DEFAULT_FUSIONS, load_rules, part_names
from .layout_text import format_layout, parse_layout
from .limits import MAX_LAYERS, MAX_RANKS, MAX_SPEC_FILE_BYTES, check_count, is_int
from .manifest import CHECKPOINT_DTYPES
from .model_plan import itemsize_of, model_plan
from .plan import naive_gather_bytes
from .planner import plan

CONFIG_KEYS = ("dp", "tp", "cp", "pp", "ep", "vpp")


def parse_config(text: str) -> ParallelConfig:
    """``dp=2,tp=2,pp=2,opt`` (opt = optimizer sharding), a JSON file of the fields, or an
    ms-layout msgpack file of a ParallelConfig; at most MS_RESHARD_MAX_RANKS ranks."""
    if os.path.isfile(text):
        try:
            blob = read_capped(text, MAX_SPEC_FILE_BYTES.value, "config file")
            if blob[:1] != b"{":
                return _checked_config(loads(blob, "ParallelConfig"), text)
            data = json.loads(blob.decode("utf-8"))
        except (LayoutError, FileError, ValueError) as exc:  # ValueError: bad UTF-8 or JSON
            raise ReshardError(f"{text}: not a ParallelConfig ({exc})") from None
        if not isinstance(data, dict):
            raise ReshardError(f"{text}: not a ParallelConfig (a JSON {type(data).__name__}, expected an object)")
        fields = data
    else:
        fields = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, value = item.partition("=")
            if key in ("opt", "optimizer_shard") and not sep:
                fields["optimizer_shard"] = True
            elif key == "order" and sep:
                fields["order"] = value.replace("_", "-")
            elif key in CONFIG_KEYS and value.isascii() and value.isdigit():
                fields[key] = int(value)
            else:
                raise ReshardError(
                    f"config entry {item!r} in {text!r}: expected dp=N, tp=N, cp=N, pp=N, ep=N, vpp=N or opt"
                )
    # Refuse a world too large before ParallelConfig builds its meshes (one entry per rank).
    sizes = [fields.get(k, 1) for k in ("dp", "tp", "cp", "pp")]
    if all(is_int(s) and s > 0 for s in sizes):
        check_count(math.prod(sizes), MAX_RANKS, f"ranks (dp*tp*cp*pp) of config {text!r}")
    try:
        return _checked_config(ParallelConfig.from_dict(fields), text)
    except LayoutError as exc:
        raise ReshardError(f"config {text!r}: {exc}") from None


def _checked_config(config: ParallelConfig, text: str) -> ParallelConfig:
    check_count(config.world_size, MAX_RANKS, f"ranks (dp*tp*cp*pp) of config {text!r}")
    return config


def plan_report(p, ops: bool) -> dict:
    """Everything `ms-reshard plan` prints, as plain data."""
    report = {
        "src": format_layout(p.src),
        "dst": format_layout(p.dst),
        "shape": list(p.shape),
        "itemsize": p.itemsize,
        "rounds": p.rounds,
        "bytes_moved": p.bytes_moved(),
        "lower_bound": p.lower_bound_total(),
        "naive_gather_bytes": naive_gather_bytes(p),
        "ranks": p.per_rank(),
        "notes": list(p.notes),
    }
    if ops:
        report["ops"] = {str(r): [str(o) for o in ops_] for r, ops_ in p.ops_by_rank().items()}
    return report


def _print_plan(p, report: dict, max_ranks: int, ops: bool) -> None:
    from .plan import format_plan

    print(format_plan(p, max_ranks=max_ranks, ops=ops))
    print(f"  naive gather-then-slice would receive {report['naive_gather_bytes']} B")


def _cmd_plan(args) -> None:
    src, dst = parse_layout(args.src), parse_layout(args.dst)
    shape = _ints(args.shape, "--shape")
    p = plan(src, dst, shape, itemsize_of(args.dtype), args.mem_cap, not args.no_collectives)
    report = plan_report(p, ops=not args.no_ops)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print_plan(p, report, args.max_ranks, not args.no_ops)


def _cmd_checkpoint(args) -> None:
    from .checkpoint import check_target, load_manifest, manifest_specs, reshard_checkpoint, verify
    from .specs import param_specs

    # Every input is checked before the progress bars start, so an error is the only line printed.
    if args.dst_dtype is not None and args.dst_dtype not in CHECKPOINT_DTYPES:
        raise ReshardError(f"--dst-dtype {args.dst_dtype!r}: a checkpoint holds one of {list(CHECKPOINT_DTYPES)}")
    manifest = load_manifest(args.src_dir)
    src_specs = manifest_specs(manifest)
    num_layers, num_experts = _model_facts(manifest, args)
    fusions = load_rules(args.fusion) if args.fusion else DEFAULT_FUSIONS
    if args.src_config:
        # The manifest's layouts are what the files hold; a given config must agree with them.
        _check_src_config(parse_config(args.src_config), src_specs, num_layers, num_experts)
    dst_config = parse_config(args.dst_config)
    shapes = {n: s.shape for n, s in src_specs.items()}
    dst_specs = param_specs(shapes, dst_config, num_layers, num_experts, fusions=fusions if args.fuse else ())
    for name, spec in dst_specs.items():  # each parameter keeps its dtype unless told otherwise
        first = name if name in src_specs else part_names(name, fusions)[0][0]
        dst_specs[name] = dataclasses.replace(spec, dtype=args.dst_dtype or src_specs[first].dtype)
    mp = model_plan(src_specs, dst_specs, fusions=fusions)
    check_target(args.dst_dir, args.overwrite)
    verify(args.src_dir, manifest, progress=not args.json)
    out = reshard_checkpoint(args.src_dir, args.dst_dir, mp, manifest, dst_config, args.overwrite, not args.json)
    summary = {
        "src": str(args.src_dir),
        "dst": str(args.dst_dir),
        "params": len(out["params"]),
        "files": len(out["files"]),
        "bytes_written": sum(e["bytes"] for e in out["files"].values()),
        "bytes_moved_between_ranks": mp.bytes_moved(),
        "lower_bound": mp.lower_bound_total(),
    }
    print(json.dumps(summary, indent=1) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))


def _check_src_config(config, src_specs, num_layers, num_experts) -> None:
    from .specs import param_specs

    want = param_specs({n: s.shape for n, s in src_specs.items()}, config, num_layers, num_experts)
    for name, spec in src_specs.items():
        if want[name].layout != spec.layout:
            raise ReshardError(
                f"--src-config {config.describe()} gives {name!r} layout {format_layout(want[name].layout)}, "
                f"but the checkpoint holds {format_layout(spec.layout)}"
            )


def _model_facts(manifest, args) -> tuple[int, int | None]:
    model = manifest.get("model") or {}
    num_layers = args.num_layers if args.num_layers is not None else model.get("num_layers")
    if num_layers is None:
        raise ReshardError("the number of decoder layers is needed for pipeline stages: pass --num-layers")
    if num_layers < 1:
        raise ReshardError(f"--num-layers {num_layers}: expected a positive number of decoder layers")
    check_count(num_layers, MAX_LAYERS, "--num-layers")
    num_experts = args.num_experts if args.num_experts is not None else model.get("num_experts")
    if num_experts is not None and num_experts < 1:
        raise ReshardError(f"--num-experts {num_experts}: expected a positive number of experts")
    return num_layers, num_experts


def _ints(text: str, flag: str) -> list[int]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not all(x.isascii() and x.isdigit() for x in items):
        raise ReshardError(f"{flag} {text!r}: expected comma-separated non-negative ints")
    return [int(x) for x in items]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ms-reshard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan one tensor between two layouts")
    p.add_argument("--src", required=True, help="source layout MESH:MAP[@RANKS], e.g. dp=2,tp=2:tp,None, or a file")
    p.add_argument("--dst", required=True, help="target layout, same syntax")
    p.add_argument("--shape", required=True, help="global shape: 8,8")
    p.add_argument("--dtype", default="float32", help="element type, for byte counts (default float32)")
    p.add_argument("--mem-cap", type=int, default=None, help="bytes of buffers a rank may hold per round")
    p.add_argument("--no-collectives", action="store_true", help="keep every transfer point-to-point")
    p.add_argument("--no-ops", action="store_true", help="omit the per-rank op lists")
    p.add_argument("--max-ranks", type=int, default=16, help="ranks shown in text output (default 16)")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    c = sub.add_parser("checkpoint", help="reshard a sharded safetensors checkpoint")
    c.add_argument("src_dir")
    c.add_argument("dst_dir")
    c.add_argument("--dst-config", required=True, help="target ParallelConfig: tp=4 or dp=2,tp=2,pp=2,opt or a file")
    c.add_argument("--src-config", help="check the source checkpoint was sharded by this config")
    c.add_argument("--fuse", action="store_true", help="fuse q/k/v and gate/up (or --fusion rules) in the target")
    c.add_argument("--fusion", help="JSON file of fusion rules (default: qkv_proj, gate_up_proj)")
    c.add_argument("--num-layers", type=int, help="decoder layers (default: from the manifest)")
    c.add_argument("--num-experts", type=int, help="routed experts (default: from the manifest)")
    c.add_argument("--dst-dtype", help="cast every parameter to this dtype")
    c.add_argument("--overwrite", action="store_true", help="replace DST_DIR if it exists (atomically)")
    c.add_argument("--json", action="store_true", help="print a JSON summary, no progress bars")
    return parser


def _run(args) -> None:
    _cmd_plan(args) if args.command == "plan" else _cmd_checkpoint(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; bad input is one line on stderr and exit code 2 (--debug shows the traceback)."""
    return run_console("ms-reshard", build_parser(), _run, argv, (ReshardError, LayoutError))


if __name__ == "__main__":
    raise SystemExit(main())
