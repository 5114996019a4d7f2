"""`ms-probe`: compare dumps, align module trees, list shipped mappings.

    ms-probe compare --target DIR --golden DIR --out DIR [--mapping NAME|FILE [--reverse-mapping]]
                     [--auto-align] [--step N ...] [--rank R ...] [--no-html] [--json]
    ms-probe align --target DIR --golden DIR [--json]
    ms-probe mappings [--json]

Without --mapping, items align by identical paths; when fewer than 60% of the target's modules find
a counterpart that way, the trees are aligned automatically (--auto-align forces it) and the
confidence is reported. Exit status (EXIT_CODES): 0 done; with --fail-on-divergence, 1 when a
divergence or a NaN/Inf was found and 3 when a dump is damaged or unverifiable (3 wins over 1: the
verdicts of a damaged dump are not to be trusted); 2 bad input (one line on stderr; --debug shows
the traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from ms_layout.console import run_console

from .align import auto_align
from .compare import compare_dirs
from .errors import ProbeError
from .mapping import NameMapping, load_mapping, shipped_mappings
from .output import write_results
from .reader import find_rank_dirs, load_rank

AUTO_ALIGN_BELOW = 0.6
EXIT_DIVERGENCE, EXIT_USAGE, EXIT_DAMAGED = 1, 2, 3
EXIT_CODES = f"""exit status:
  0  done (without --fail-on-divergence: whatever the verdict)
  {EXIT_DIVERGENCE}  --fail-on-divergence: a divergence or a NaN/Inf was found
  {EXIT_USAGE}  bad input: a missing or malformed dump, mapping or argument (one line on stderr)
  {EXIT_DAMAGED}  --fail-on-divergence: a dump is damaged or unverifiable (wins over {EXIT_DIVERGENCE})
"""


def _identity_coverage(target_dir: str, golden_dir: str) -> tuple[float, object, object]:
    t_key, t_path = next(iter(sorted(find_rank_dirs(target_dir).items(), key=str)))
    g_key, g_path = next(iter(sorted(find_rank_dirs(golden_dir).items(), key=str)))
    td, gd = load_rank(t_path, *t_key), load_rank(g_path, *g_key)
    g_paths = {i.parsed.path for i in gd.items.values() if i.parsed.kind == "module"}
    t_paths = {i.parsed.path for i in td.items.values() if i.parsed.kind == "module"}
    return (len(t_paths & g_paths) / len(t_paths) if t_paths else 1.0), td, gd


def _choose_mapping(args) -> tuple[NameMapping, dict]:
    if args.mapping:
        return load_mapping(args.mapping, reverse=args.reverse_mapping), {"mapping": args.mapping}
    coverage, td, gd = _identity_coverage(args.target, args.golden)
    if args.auto_align or coverage < AUTO_ALIGN_BELOW:
        alignment = auto_align(td, gd)
        return alignment.to_mapping(), {
            "mapping": "auto",
            "identity_coverage": round(coverage, 4),
            "alignment_confidence": round(alignment.confidence, 4),
            "aligned_modules": len(alignment.pairs),
        }
    return NameMapping(), {"mapping": "identity", "identity_coverage": round(coverage, 4)}


def _damage_line(d: dict) -> str:
    return f"{d['side']} step {d['step']} rank {d['rank']} ({d['folder']}): " + "; ".join(d["reasons"])


def cmd_compare(args) -> int:
    mapping, how = _choose_mapping(args)
    if args.pipeline and args.rank:
        raise ProbeError("compare: --pipeline merges every rank of the target; it takes no --rank")
    if args.pipeline:
        run = compare_dirs(args.target, args.golden, mapping, steps=args.step, merge_target_ranks=True)
    else:
        run = compare_dirs(args.target, args.golden, mapping, steps=args.step, ranks=args.rank)
    files = write_results(run, args.out, html=not args.no_html)
    summary = {**run.summary(), "alignment": how, "files": files}
    for d in summary["damaged"]:
        print(f"ms-probe: damaged dump: {_damage_line(d)}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
    else:
        print(f"alignment: {how}")
        for rc in run.ranks:
            s = rc.summary()
            print(
                f"step {rc.step} rank {rc.rank}: {rc.mode} mode, {s['aligned_items']} items aligned, "
                f"{s['target_only']} only in target, {s['golden_only']} only in golden, results {s['item_results']}"
            )
            print(
                f"  first divergence: {rc.first_divergence or 'none'}"
                + (f" ({rc.first_divergence_reason})" if rc.first_divergence else "")
                + (
                    " in stage {stage}, microbatch {microbatch}, pass {pass}".format(**rc.first_where)
                    if rc.first_where
                    else ""
                )
            )
            for a in rc.anomaly_list():
                print(f"  first nan/inf: {a['side']} {a['item']} {a['key']} ({a['what']})")
        for p in summary["problems"]:
            print(f"problem: {p}")
        for d in summary["damaged"]:
            print(f"damaged: {_damage_line(d)}")
        print(f"wrote {', '.join(sorted(files))} to {args.out}")
    if not args.fail_on_divergence:
        return 0
    if summary["damaged"]:
        return EXIT_DAMAGED
    return EXIT_DIVERGENCE if summary["first_divergence"] or summary["anomalies"] else 0


def cmd_align(args) -> int:
    _, td, gd = _identity_coverage(args.target, args.golden)
    alignment = auto_align(td, gd)
    if args.json:
        print(json.dumps(alignment.to_dict(), indent=1))
    else:
        print(f"confidence {alignment.confidence:.3f}: {len(alignment.pairs)} modules aligned")
        for p in alignment.pairs:
            print(f"  {p.score:.2f}  {p.target}  ->  {p.golden}")
        for p in alignment.target_only:
            print(f"  only in target: {p}")
        for p in alignment.golden_only:
            print(f"  only in golden: {p}")
    return 0


def cmd_mappings(args) -> int:
    maps = shipped_mappings()
    if args.json:
        print(json.dumps(maps, indent=1))
    else:
        for name, desc in maps.items():
            print(f"{name}: {desc}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ms-probe", description="Compare precision dumps in msprobe's format.")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser(
        "compare",
        help="compare a target dump with a golden dump",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("--target", required=True, help="target dump: root, step folder or rank folder")
    c.add_argument("--golden", required=True, help="golden (bench) dump")
    c.add_argument("--out", required=True, help="output folder for CSV, JSON and report.html")
    c.add_argument("--mapping", help="shipped mapping name or YAML file (target -> golden)")
    c.add_argument("--reverse-mapping", action="store_true", help="read the mapping golden -> target")
    c.add_argument("--auto-align", action="store_true", help="align the module trees automatically")
    c.add_argument("--step", type=int, nargs="*", help="only these steps")
    c.add_argument("--rank", type=int, nargs="*", help="only these ranks")
    c.add_argument("--no-html", action="store_true", help="skip report.html")
    c.add_argument(
        "--pipeline",
        action="store_true",
        help="the target is a pipelined step: merge its ranks' dumps of each step into one and compare it "
        "with the golden's single rank (dumps written with PrecisionDebugger.pipeline_pass)",
    )
    c.add_argument(
        "--fail-on-divergence",
        action="store_true",
        help=f"exit {EXIT_DIVERGENCE} on a divergence or NaN/Inf, {EXIT_DAMAGED} on a damaged dump (see below)",
    )
    c.add_argument("--json", action="store_true", help="print the summary as JSON")
    c.set_defaults(fn=cmd_compare)
    a = sub.add_parser("align", help="align two module trees automatically and print the pairs")
    a.add_argument("--target", required=True)
    a.add_argument("--golden", required=True)
    a.add_argument("--json", action="store_true")
    a.set_defaults(fn=cmd_align)
    m = sub.add_parser("mappings", help="list the shipped name mappings")
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=cmd_mappings)
    for parser in (c, a, m):  # `ms-probe compare ... --debug` as well as `ms-probe --debug compare ...`
        parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback")
    return p


def _run(args) -> int:
    return args.fn(args)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    return run_console("ms-probe", build_parser(), _run, argv, (ProbeError,))


if __name__ == "__main__":
    sys.exit(main())
