"""bench_reshard: planning time at DeepSeek-V3 scale, bytes moved against baselines, online throughput.

    python benchmarks/bench_reshard.py [--quick] --out benchmarks/results/reshard.json
    python benchmarks/bench_reshard.py --planning-only [--ranks 4096]   # section 1 only
    python benchmarks/bench_reshard.py --online-only                    # section 3 only

1. Planning (_reshard_planning.py): the whole DeepSeek-V3 parameter list with its MTP layer, from
   training (tp8 pp16 ep + ZeRO, and an earlier no-tp config) to serving (tp8 ep), on 1024 and
   4096 ranks: seconds to derive the layouts and to plan, peak RSS, bytes against the lower bound.
2. Bytes: single tensors between layout pairs: ours, the lower bound, the naive plan, and MindSpore's
   own redistribution (mindspore.parallel._tensor._transform_tensor_by_layout, the offline helper
   its checkpoint transform uses), for the pairs it can plan; the others say why not.
3. Online (_reshard_online.py): a Llama-like model resharded on 2 and 4 CPU ranks over gloo, against
   one all-to-all of the same bytes and other transport floors, median of alternated repeats.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from _common import machine_info
from _reshard_online import bench_online
from _reshard_planning import CONFIGS, SCALES, planning_row, short

from ms_layout import Layout
from ms_reshard import plan
from ms_reshard.plan import naive_gather_bytes

GB, MB = 1e9, 1e6


# ---------------------------------------------------------------- 2. bytes against MindSpore
def _pairs() -> list[tuple[str, Layout, Layout, tuple[int, ...]]]:
    t8, t4 = Layout((8,), ("tp",)), Layout((4,), ("tp",))
    d2t4, d4t2 = Layout((2, 4), ("dp", "tp")), Layout((4, 2), ("dp", "tp"))
    big = (8192, 8192)
    return [
        ("tp8 column -> dp2 x tp4 column", t8("tp", "None"), d2t4("tp", "None"), big),
        ("dp2 x tp4 column -> tp8 column", d2t4("tp", "None"), t8("tp", "None"), big),
        ("tp8 row -> tp8 column (transpose split)", t8("None", "tp"), t8("tp", "None"), big),
        ("dp2 x tp4 column -> replicated on 8", d2t4("tp", "None"), t8("None", "None"), big),
        ("dp4 x tp2 optimizer-sharded -> tp8", d4t2(("tp", "dp"), "None"), t8("tp", "None"), big),
        ("2x3 mesh -> 3x2 mesh", Layout((2, 3), ("a", "b"))("a", "b"), Layout((3, 2), ("a", "b"))("a", "b"),
         (6144, 6144)),
        ("tp8 on 8 ranks -> tp4 on ranks 0-3", t8("tp", "None"), t4("tp", "None"), big),
        ("pp stage move: tp4 ranks 4-7 -> tp4 ranks 0-3",
         Layout((4,), ("tp",), rank_list=(4, 5, 6, 7))("tp", "None"), t4("tp", "None"), big),
    ]  # fmt: skip


def mindspore_bytes(src: Layout, dst: Layout, shape) -> tuple[int | None, int | None, str]:
    """Bytes MindSpore's offline redistribution receives (total, max rank), or why it cannot plan."""
    if src.ranks != dst.ranks:
        return None, None, "cannot: rank sets differ (its repeat axis replicates the target over all ranks)"
    if any(isinstance(t, tuple) for t in (*src.tensor_map, *dst.tensor_map)):
        return None, None, "cannot: multi-axis tensor map (needs its opt-shard/expand rewrite first)"
    try:
        from mindspore.parallel._tensor import _transform_tensor_by_layout
    except ImportError:
        return None, None, "mindspore not installed"
    from_layout = (list(src.device_matrix), list(src.tensor_map), list(shape))
    to_layout = (list(dst.device_matrix), list(dst.tensor_map), list(shape))
    total, worst = 0, 0
    for rank in src.ranks:
        ops = _transform_tensor_by_layout(from_layout, to_layout, list(src.ranks), rank)
        cur, got = list(src.shard_shape(shape)), 0
        for name, args in ops:
            if name == "StridedSlice":
                k = len(args) // 3
                cur = [args[k + i] - args[i] for i in range(k)]
            elif name == "AllConcat":  # every member receives the others' current blocks
                group, axis = args[:-1], args[-1]
                got += (len(group) - 1) * math.prod(cur)
                cur[axis] *= len(group)
            elif name == "Reshape":
                cur = list(args)
            else:
                return None, None, f"unknown op {name}"
        if tuple(cur) != dst.shard_shape(shape):
            return None, None, f"its ops end in shape {cur} on rank {rank}"
        total, worst = total + got, max(worst, got)
    return total * 2, worst * 2, "planned"


def bench_bytes() -> list[dict]:
    rows = []
    for name, src, dst, shape in _pairs():
        p = plan(src, dst, shape, itemsize=2)
        ms_total, ms_max, note = mindspore_bytes(src, dst, shape)
        ours = p.bytes_moved()
        rows.append(
            {
                "section": "bytes",
                "case": name,
                "shape": "x".join(map(str, shape)),
                "ours_MB": round(ours / MB, 1),
                "ours_max_rank_MB": round(int(p.received.max()) / MB, 1),
                "lower_bound_MB": round(p.lower_bound_total() / MB, 1),
                "naive_MB": round(naive_gather_bytes(p) / MB, 1),
                "mindspore_MB": None if ms_total is None else round(ms_total / MB, 1),
                "mindspore_max_rank_MB": None if ms_max is None else round(ms_max / MB, 1),
                "mindspore/ours": None if ms_total is None or not ours else round(ms_total / ours, 2),
                "collectives": ",".join(sorted({c.kind.value for c in p.collectives})) or "-",
                "mindspore": note,
            }
        )
    return rows


# ---------------------------------------------------------------- output
def print_rows(rows: list[dict]) -> None:
    sections: dict[str, list[dict]] = {}
    for row in rows:
        sections.setdefault(row["section"], []).append(row)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    for name, group in sections.items():
        cols = [c for c in group[0] if c != "section"]
        if Console is None:
            print(f"\n[{name}]")
            for row in group:
                print("  " + "  ".join(f"{c}={row[c]}" for c in cols))
            continue
        table = Table(title=name)
        for c in cols:
            table.add_column(c)
        for row in group:
            table.add_row(*[str(row[c]) for c in cols])
        Console(width=220).print(table)


def summary(rows: list[dict], old: dict) -> dict:
    """The headline figures: the tp8 config's layout and plan seconds and peak RSS, moved bytes /
    lower bound, the online executor's time over its baselines (medians of alternated repeats)."""
    out = dict(old)
    for row in rows:
        if row["section"] == "planning" and row["case"].endswith("tp8") and " 61 layers" in row["case"]:
            world = row["case"].split(", ")[1].split()[0]
            out[f"plan_s_{world}"] = row["plan_s"]
            out[f"layouts_s_{world}"] = row["layouts_s"]
            out[f"layouts_plus_plan_s_{world}"] = row["layouts+plan_s"]
            out[f"peak_rss_gb_{world}"] = row["peak_rss_GB"]
    ratios = [r["moved/lower_bound"] for r in rows if r["section"] == "planning"]
    if ratios:
        out["moved_over_lower_bound"] = max(ratios)
    for row in rows:  # the online executor against one all-to-all of the same bytes
        if row["section"] == "online" and row["case"].endswith("bucketed"):
            n = row["case"].split(" gloo ranks")[0].rsplit(" ", 1)[1]
            out[f"online_over_all_to_all_{n}"] = row["reshard/all_to_all_time"]
            out[f"online_over_all_to_all_plus_copy_{n}"] = row["reshard/(all_to_all+copy)_time"]
            if "reshard/all_to_all_same_bytes_time" in row:  # rows written before it was measured lack it
                out[f"online_over_all_to_all_same_bytes_{n}"] = row["reshard/all_to_all_same_bytes_time"]
    return out


def write(path: str, rows: list[dict], full: bool, replace: frozenset[str] | set[str] = frozenset()) -> None:
    """Write `rows` into the JSON at `path`; unless `full`, the other rows stay (a partial run
    replaces its own cases, the sections in `replace` whole, and the planning rows written before
    the configs were named)."""
    old: dict = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    cases = {(r["section"], r["case"]) for r in rows}
    kept = [
        r
        for r in ([] if full else old.get("rows", []))
        if (r["section"], r["case"]) not in cases
        and r["section"] not in replace
        and not (r["section"] == "planning" and not r["case"].endswith(tuple(CONFIGS)))
    ]
    result = {
        "benchmark": "reshard",
        "title": "ms-reshard: planning at DeepSeek-V3 scale, bytes against MindSpore, online throughput",
        "machine": machine_info("mindspore"),
        "summary": summary(kept + rows, old.get("summary", {})),
        "rows": sorted(kept + rows, key=lambda r: ["planning", "bytes", "online"].index(r["section"])),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1024 ranks and 16 layers only, fewer repeats")
    parser.add_argument("--planning-only", action="store_true", help="run section 1 (planning) alone")
    parser.add_argument("--online-only", action="store_true", help="run section 3 (online) alone")
    parser.add_argument("--ranks", type=int, action="append", choices=sorted(SCALES), help="planning at N ranks only")
    parser.add_argument("--out", default="benchmarks/results/reshard.json")
    args = parser.parse_args(argv)
    rows = []
    if args.online_only:
        rows = bench_online(3 if args.quick else 9, short)
        print_rows(rows)
        write(args.out, rows, full=False, replace={"online"})
        return 0
    worlds = args.ranks or sorted(SCALES)
    scales = [(1024, 16)] if args.quick else [(w, 61) for w in worlds]
    configs = ["tp8"] if args.quick or args.ranks else ["tp8", "no-tp"]
    for config in configs:
        for world, layers in scales:
            rows.append(planning_row(world, layers, config))
            print(rows[-1], file=sys.stderr)
    if not (args.planning_only or args.ranks):
        rows += bench_bytes()
        rows += bench_online(3 if args.quick else 9, short)
    print_rows(rows)
    # a run of every planning row replaces the section (its case names changed with the MTP layer)
    whole = args.planning_only and not args.ranks and not args.quick
    write(args.out, rows, full=not (args.planning_only or args.ranks), replace={"planning"} if whole else set())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
