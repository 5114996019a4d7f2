"""The `ms-layout` console script: rank tables, groups and tensor layouts, as text or JSON.

ms-layout config --dp 2 --tp 2 --pp 2 [--json]
ms-layout layout --mesh dp=2,sp=2,mp=2 --map mp,sp+dp --shape 8,8 [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .console import run_console
from .errors import LayoutError
from .layout import NONE, Layout
from .parallel_config import ParallelConfig

GROUP_TOKENS = ("tp", "cp", "dp", "pp", "ep", "edp", "dp-cp", "tp-pp")
COLUMNS = ("rank", "pp", "dp", "cp", "tp", "ep", "edp")


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, header))] + [list(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def config_report(config: ParallelConfig) -> dict:
    """Everything `ms-layout config` prints, as plain data."""
    groups = {}
    for token in GROUP_TOKENS:
        found = config.groups(token)
        if len(found[0]) > 1:  # a group of one rank says nothing
            groups[token] = [list(g) for g in found]
    return {
        "config": config.to_dict(),
        "world_size": config.world_size,
        "mesh": {"axes": list(config.mesh.alias_names), "sizes": list(config.mesh.device_matrix)},
        "expert_mesh": {"axes": list(config.expert_mesh.alias_names), "sizes": list(config.expert_mesh.device_matrix)},
        "ranks": config.rank_table(),
        "groups": groups,
    }


def layout_report(layout: Layout, shape: Sequence[int]) -> dict:
    """Every rank's shard of a global shape under a layout, as plain data."""
    shards = []
    for rank, box in layout.iter_shards(shape):
        shards.append(
            {
                "rank": rank,
                "chunk": list(layout.chunk_index(rank)),
                "slice": [[s.start, s.stop] for s in box],
                "replicas": list(layout.replicas(rank)),
            }
        )
    return {
        "layout": layout.to_dict(),
        "tensor_map": [list(t) if isinstance(t, tuple) else t for t in layout.tensor_map],
        "global_shape": list(shape),
        "shard_shape": list(layout.shard_shape(shape)),
        "shards": shards,
    }


def _print_config(report: dict) -> None:
    cfg = ParallelConfig.from_dict(report["config"])
    print(cfg.describe())
    print(
        f"dense mesh {dict(zip(report['mesh']['axes'], report['mesh']['sizes']))}, "
        f"expert mesh {dict(zip(report['expert_mesh']['axes'], report['expert_mesh']['sizes']))}\n"
    )
    print(_table(COLUMNS, [[row[c] for c in COLUMNS] for row in report["ranks"]]))
    print()
    for token, groups in report["groups"].items():
        print(f"{token:>6} groups: " + " ".join("[" + ",".join(map(str, g)) + "]" for g in groups))


def _print_layout(layout: Layout, report: dict) -> None:
    print(f"{layout}  tensor_map={layout.tensor_map}")
    print(f"global shape {tuple(report['global_shape'])} -> shard shape {tuple(report['shard_shape'])}\n")
    rows = []
    for s in report["shards"]:
        box = ", ".join(f"{a}:{b}" for a, b in s["slice"])
        rows.append([s["rank"], tuple(s["chunk"]), f"[{box}]", ",".join(map(str, s["replicas"]))])
    print(_table(("rank", "chunk", "global slice", "replicas"), rows))


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise LayoutError(f"expected comma-separated ints, got {text!r}") from None


def _parse_layout(mesh: str, tensor_map: str) -> Layout:
    names, sizes = [], []
    for item in mesh.split(","):
        name, _, size = item.partition("=")
        if not size:
            raise LayoutError(f"mesh entry {item!r} must look like name=size")
        names.append(name)
        sizes.extend(_ints(size))
    specs = [tuple(d.split("+")) if "+" in d else d for d in tensor_map.split(",")]
    return Layout(tuple(sizes), tuple(names))(*[NONE if s in ("", "-") else s for s in specs])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ms-layout", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    cfg = sub.add_parser("config", help="rank table and groups of a ParallelConfig")
    for name in ("dp", "tp", "cp", "pp", "ep", "vpp"):
        cfg.add_argument(f"--{name}", type=int, default=1, help=f"{name} size (default 1)")
    cfg.add_argument("--optimizer-shard", action="store_true", help="shard optimizer state over dp/cp")
    cfg.add_argument("--order", default="tp-cp-ep-dp-pp", help="rank order, fastest first")
    cfg.add_argument("--json", action="store_true", help="print JSON for machines")
    lay = sub.add_parser("layout", help="every rank's shard of a tensor under a layout")
    lay.add_argument("--mesh", required=True, help="mesh axes, slowest first: dp=2,sp=2,mp=2")
    lay.add_argument("--map", required=True, help="per tensor dim: an axis, axes joined by +, or None")
    lay.add_argument("--shape", required=True, help="global shape: 8,8")
    lay.add_argument("--json", action="store_true", help="print JSON for machines")
    for p in (cfg, lay):  # `ms-layout config --dp 3 --debug` as well as `ms-layout --debug config ...`
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "config":
        config = ParallelConfig(
            dp=args.dp,
            tp=args.tp,
            cp=args.cp,
            pp=args.pp,
            ep=args.ep,
            vpp=args.vpp,
            optimizer_shard=args.optimizer_shard,
            order=args.order,
        )
        report = config_report(config)
        print(json.dumps(report, indent=1)) if args.json else _print_config(report)
    else:
        layout = _parse_layout(args.mesh, args.map)
        report = layout_report(layout, _ints(args.shape))
        print(json.dumps(report, indent=1)) if args.json else _print_layout(layout, report)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "config")  # `ms-layout --tp 2` means `ms-layout config --tp 2`
    return run_console("ms-layout", build_parser(), _run, argv, (LayoutError,))


if __name__ == "__main__":
    raise SystemExit(main())
