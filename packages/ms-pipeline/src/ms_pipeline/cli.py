"""The ``ms-pipeline`` console script.

ms-pipeline simulate --schedule zbv --stages 4 --microbatches 8 [--costs f=1,b=1,w=1,comm=0] [--json]
    (--schedule zbv-adaptive: ZeroBubbleV ordered for the given costs)
ms-pipeline draw     --schedule zbv --stages 4 --microbatches 8 -o zbv.png [--trace zbv.json]
ms-pipeline show     --schedule zbv --stages 4 --microbatches 8 [--lowered] [--csv]
ms-pipeline validate schedule.csv [--torch]
ms-pipeline run      --schedule zbv --stages 2 --microbatches 4 [--json]   (needs the runtime extra)

``--stages`` is the pipeline degree p (ranks); ZeroBubbleV and interleaved place more than one
stage (chunk) per rank. ``--costs`` describe one rank's share of the model for one microbatch, so
schedules with v chunks per rank are simulated with each cost divided by v: every schedule is
compared on the same model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from ms_layout.console import run_console
from ms_layout.limits import Limit

from .errors import ScheduleError
from .ir import Schedule
from .lower import lower
from .schedules import BUILDERS, build
from .serialize import load, to_csv
from .simulate import CostModel, simulate
from .validate import validate

MAX_LOCAL_RANKS = Limit("MS_PIPELINE_MAX_LOCAL_RANKS", 16, "local processes")
"""Ranks `ms-pipeline run` starts on this machine (each one a MindSpore process)."""


def _check_output(path: str, what: str) -> None:
    """Refuse an output path that cannot be a file before any work is done."""
    target = Path(path)
    if target.is_dir():
        raise ScheduleError(f"{what} {path!r} is a folder; give a file name")
    if not target.parent.is_dir():
        raise ScheduleError(f"cannot write {what} {path!r}: folder {str(target.parent)!r} does not exist")


@contextlib.contextmanager
def _writing(path: str, what: str) -> Iterator[None]:
    """Name the file the user asked for (not the temporary name beside it) when a write fails."""
    _check_output(path, what)
    try:
        yield
    except OSError as exc:
        raise ScheduleError(f"cannot write {what} {path!r}: {exc.strerror or exc}") from None


def _schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", required=True, choices=sorted(BUILDERS), help="schedule family")
    p.add_argument("--stages", type=int, required=True, help="pipeline degree p (number of ranks)")
    p.add_argument("--microbatches", type=int, required=True, help="microbatches per step m")
    p.add_argument("--chunks", type=int, default=2, help="stages per rank for --schedule interleaved")
    p.add_argument("--overlap", action="store_true", help="zbv: fuse the steady phase into 1B1F pairs")


def _cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costs", default="", help="per-rank costs, e.g. f=1,b=1,w=0.63,comm=0 (default all 1, comm 0)")
    p.add_argument("--profile", choices=["zb"], help="zb: the Zero Bubble authors' measured profile (W = 0.63 F)")


def _build(args: argparse.Namespace, costs: CostModel | None = None) -> Schedule:
    options = {}
    if args.schedule == "zbv-adaptive":
        # ordered for the same costs it is then simulated with (two chunks per rank)
        options["costs"] = costs or CostModel().split(2)
    if args.schedule == "interleaved":
        options["stages_per_rank"] = args.chunks
    if args.overlap:
        if args.schedule != "zbv":
            raise ScheduleError("--overlap applies to --schedule zbv only")
        options["overlap"] = True
    return build(args.schedule, args.stages, args.microbatches, **options)


def _costs(args: argparse.Namespace, chunks: int) -> CostModel:
    base = CostModel.zb_profile() if args.profile == "zb" else CostModel()
    return CostModel.parse(args.costs, base).split(chunks)


def _built_with_costs(args: argparse.Namespace) -> tuple[Schedule, CostModel]:
    schedule = _build(args, _costs(args, 2) if args.schedule == "zbv-adaptive" else None)
    return schedule, _costs(args, schedule.stages_per_rank)


def _simulate(args: argparse.Namespace) -> int:
    schedule, costs = _built_with_costs(args)
    validate(schedule)
    result = simulate(schedule, costs)
    report = {
        "schedule": schedule.name,
        "stages": args.stages,
        "microbatches": args.microbatches,
        "makespan": result.makespan,
        "bubble_rate": result.bubble_rate,
        "bubble_rate_zb": result.bubble_rate_zb,
        "peak_activation": list(result.peak_activation),
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{schedule.name}: p={args.stages} m={args.microbatches} ({schedule.num_stages} stages)")
    print(f"makespan          {result.makespan:.4f}")
    print(f"bubble_rate       {result.bubble_rate:.4f}   idle / (ranks x makespan)")
    print(f"bubble_rate_zb    {result.bubble_rate_zb:.4f}   Zero Bubble authors' definition")
    print("peak_activation   " + " ".join(f"{x:.3g}" for x in result.peak_activation) + "   per rank")
    return 0


def _draw(args: argparse.Namespace) -> int:
    from .draw import draw_png, write_chrome_trace

    _check_output(args.output, "PNG")
    if args.trace:
        _check_output(args.trace, "trace")
    schedule, costs = _built_with_costs(args)
    validate(schedule)
    result = simulate(schedule, costs)
    with _writing(args.output, "PNG"):
        draw_png(result, args.output, stage_to_rank=schedule.stage_to_rank)
    print(f"wrote {args.output}")
    if args.trace:
        with _writing(args.trace, "trace"):
            write_chrome_trace(args.trace, result.timeline, name=schedule.name)
        print(f"wrote {args.trace}")
    return 0


def _show(args: argparse.Namespace) -> int:
    schedule = _build(args)
    if args.lowered:
        schedule = lower(schedule)
    print(to_csv(schedule) if args.csv else schedule.to_text(), end="")
    return 0


def _validate_file(args: argparse.Namespace) -> int:
    if args.torch and not args.file.lower().endswith(".csv"):
        raise ScheduleError(f"--torch reads PyTorch's CSV; {args.file!r} is not a .csv file")
    schedule = load(args.file, dialect="torch") if args.torch else load(args.file)
    validate(schedule)
    print(f"ok: {schedule.header()}")
    return 0


def _run(args: argparse.Namespace) -> int:
    if not args.timeout > 0 or args.timeout == float("inf"):
        raise ScheduleError(f"--timeout {args.timeout} must be a positive number of seconds")
    MAX_LOCAL_RANKS.check(args.stages, "--stages", ScheduleError)
    from .runtime.demo import run_demo

    report = run_demo(_build(args), seed=args.seed, timeout=args.timeout)
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:<22} {value}")
    return 0 if report["matches_reference"] else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ms-pipeline", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("simulate", help="makespan, bubble rate and peak activation memory of a schedule")
    _schedule_args(p)
    _cost_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_simulate)
    p = sub.add_parser("draw", help="PNG timeline (and optionally a Chrome trace) of a simulated schedule")
    _schedule_args(p)
    _cost_args(p)
    p.add_argument("-o", "--output", required=True, help="PNG file to write")
    p.add_argument("--trace", help="also write a Chrome trace JSON here")
    p.set_defaults(fn=_draw)
    p = sub.add_parser("show", help="print a schedule's text form")
    _schedule_args(p)
    p.add_argument("--lowered", action="store_true", help="with sends and receives")
    p.add_argument("--csv", action="store_true", help="CSV instead of the text form")
    p.set_defaults(fn=_show)
    p = sub.add_parser("validate", help="validate a schedule file (.csv, .msgpack or .txt)")
    p.add_argument("file")
    p.add_argument("--torch", action="store_true", help="CSV written by PyTorch (I = dx, B = full backward)")
    p.set_defaults(fn=_validate_file)
    p = sub.add_parser("run", help="run a schedule on local CPU processes with a tiny MindSpore model")
    _schedule_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_run)
    for p in sub.choices.values():  # `ms-pipeline simulate ... --debug` as well as `ms-pipeline --debug simulate`
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_console("ms-pipeline", _parser(), lambda args: args.fn(args), argv, (ScheduleError,))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
