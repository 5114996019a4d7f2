"""The whole stack on CPU, end to end: ``python demo/run.py [--out DIR] [--quick]`` (``nox -s demo``).

1. pretrain  a tiny DeepSeek-V3 (ms-models) with ZeroBubbleV on 2 local ranks (ms-pipeline),
             paired recompute (ms-recompute), monitored (ms-monitor)
2. probe     one step of it against the single-process reference (ms-probe)
3. reshard   the pipeline-stage shards into one inference checkpoint (ms-reshard)
4. serve     it through vLLM with ms-vllm, a few greedy prompts checked against ms-models
5. grpo      GRPO with uniform sampling and dynamic packing (ms-rlhf), interrupted and resumed
6. recompute paired recompute with real communication: a tiny Llama trained with tensor
             parallelism 2 on 2 local ranks (ms-recompute, ms-models' TP shards), over a shaped
             link where network namespaces can be made (root), else loopback

Every stage checks its own claim against an independent reference; a summary table, every
stage's JSON and one HTML report (whose path is printed last) land in the output directory.
Exit status 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the demo's modules, also for spawned ranks
# MindSpore logs every deprecation and tuning hint as a WARNING on stderr, in every rank, which
# buries the demo's own progress; errors still show (GLOG_v=3). Set before MindSpore is imported.
os.environ.setdefault("GLOG_v", "3")

from common import StageResult, write_json

ROOT = Path(__file__).resolve().parent.parent


def _console():
    try:
        from rich.console import Console

        return Console(highlight=False)
    except ImportError:  # plain text without rich
        return None


def _say(console, text: str) -> None:
    if console is not None:
        console.rule(text)
    else:
        print(f"--- {text}", flush=True)


def _stages(quick: bool, fault: str = ""):
    """(name, needs, function of the work dir) in order; `needs` names the stages whose output it reads."""
    from stages import grpo, pretrain, probe, recompute_tp, reshard, serve

    pre = pretrain.PretrainConfig(fault=fault)
    gr = grpo.GrpoConfig()
    if quick:
        pre = replace(pre, steps=3)
        gr = replace(gr, steps=3, stop_after=2)
    return [
        ("pretrain", (), lambda work: pretrain.run(pre, work)),
        ("probe", ("pretrain",), lambda work: probe.run(probe.ProbeConfig(), pre, work)),
        ("reshard", ("pretrain",), lambda work: reshard.run(reshard.ReshardConfig(), work)),
        ("serve", ("reshard",), lambda work: serve.run(serve.ServeConfig(), work)),
        ("grpo", (), lambda work: grpo.run(gr, work)),
        ("recompute", (), lambda work: recompute_tp.run(recompute_tp.RecomputeConfig(), work)),
    ]


def _summary(console, results: list[StageResult]) -> None:
    rows = [
        (
            r.name,
            "pass" if r.passed else "FAIL",
            f"{r.seconds:.1f}",
            "; ".join(f"{c.name}: {c.detail}" for c in r.checks),
        )
        for r in results
    ]
    if console is None:
        for row in rows:
            print(" | ".join(row))
        return
    from rich.table import Table

    table = Table(title="demo summary")
    for column in ("stage", "result", "seconds", "checks"):
        table.add_column(column, overflow="fold")
    for name, ok, seconds, checks in rows:
        table.add_row(name, f"[green]{ok}[/]" if ok == "pass" else f"[red]{ok}[/]", seconds, checks)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="output directory (default: a new temporary one)")
    parser.add_argument("--quick", action="store_true", help="fewer training and GRPO steps (the integration test)")
    parser.add_argument(
        "--only", metavar="STAGES", help="comma-separated stages to run (with those they read), e.g. pretrain,probe"
    )
    parser.add_argument(
        "--fault", default="", metavar="BUG",
        help="inject a bug into the pipelined run to see the probe catch it: perturb-weight or lose-microbatch",
    )  # fmt: skip
    args = parser.parse_args(argv)
    from stages.pretrain import FAULTS

    if args.fault not in FAULTS:
        parser.error(f"--fault {args.fault!r}: expected one of {', '.join(f for f in FAULTS if f)}")
    stages = _stages(args.quick, args.fault)
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        names = [name for name, _, _ in stages]
        unknown = [w for w in wanted if w not in names]
        if unknown or not wanted:
            parser.error(f"--only {args.only!r}: unknown stage {unknown or wanted}; expected some of {names}")
        needed = set(wanted)
        for name, needs, _ in reversed(stages):  # the stages a wanted one reads from run too
            if name in needed:
                needed.update(needs)
        stages = [s for s in stages if s[0] in needed]
    work = (args.out or Path(tempfile.mkdtemp(prefix="ms-demo-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    console = _console()
    start = time.perf_counter()
    results: list[StageResult] = []
    done: dict[str, bool] = {}
    for i, (name, needs, fn) in enumerate(stages, 1):
        _say(console, f"[{i}/{len(stages)}] {name}")
        missing = [n for n in needs if not done.get(n)]
        if missing:
            result = StageResult(name)
            result.check("ran", False, f"skipped: {', '.join(missing)} did not pass")
        else:
            try:
                result = fn(work)
            except Exception as exc:  # a failed stage is reported, the independent ones still run
                traceback.print_exc()
                result = StageResult(name)
                result.check("ran", False, f"{type(exc).__name__}: {exc}"[:500])
        done[name] = result.passed
        results.append(result)
        write_json(work / f"{name}.json", result.to_dict())
        for c in result.checks:
            print(f"  {'ok  ' if c.passed else 'FAIL'} {c.name}: {c.detail}  [{result.seconds:.1f} s]", flush=True)
    total = time.perf_counter() - start
    from report import write_report

    path = write_report(results, work, ROOT / "benchmarks" / "results", total)
    write_json(work / "summary.json", {"total_s": total, "stages": [r.to_dict() for r in results]})
    _summary(console, results)
    ok = all(r.passed for r in results)
    print(f"{'all checks passed' if ok else 'SOME CHECKS FAILED'} in {total:.0f} s", flush=True)
    print(f"report: {path}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
