"""``ms-rlhf``: train GRPO from a config file; pack a list of lengths.

ms-rlhf train --config run.json [--resume DIR|auto] [--nprocs 2] [--set optimizer.lr=0.02] [--json]
ms-rlhf pack --lengths 5,3,8,2 --max-pack-len 10 [--max-pack-count 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys

from ms_layout.console import run_console

from .config import load_config
from .errors import RLHFError
from .limits import MAX_NPROCS, MAX_PACK_SAMPLES, MAX_SEQ_LEN

DEVICES = ("CPU", "GPU", "Ascend")


def _parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RLHFError(f"--set {item!r:.80}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except (ValueError, RecursionError):
            out[key] = value  # a bare string
    return out


def _parse_lengths(text: str) -> list[int]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    MAX_PACK_SAMPLES.check(len(items), "--lengths count", RLHFError)
    lengths = []
    for i, item in enumerate(items):
        if not re.fullmatch(r"-?\d{1,18}", item):
            raise RLHFError(f"--lengths item {i} is {item!r:.40}; expected a token count (an int >= 1)")
        lengths.append(int(item))
    return lengths


def _set_device(device: str) -> None:
    import mindspore as ms

    ms.set_device(device)


def _rank_main(group, config_dict: dict, resume: str | None, progress: bool, device: str) -> dict:
    """One rank of a local multi-rank run (module level: ranks import it)."""
    from .config import TrainConfig
    from .runtime.run import train

    _set_device(device)
    logging.basicConfig(level=logging.INFO if group.rank == 0 else logging.WARNING, format="%(message)s")
    return train(TrainConfig.from_dict(config_dict), group, resume, progress and group.rank == 0)


def cmd_train(args: argparse.Namespace) -> dict:
    if not 1 <= args.nprocs:
        raise RLHFError(f"--nprocs {args.nprocs}: expected a positive number of local ranks")
    MAX_NPROCS.check(args.nprocs, "--nprocs", RLHFError)
    if not args.timeout > 0 or args.timeout == float("inf"):
        raise RLHFError(f"--timeout {args.timeout}: expected a finite number of seconds > 0")
    if args.device not in DEVICES:
        raise RLHFError(f"--device {args.device!r:.40}: expected one of {list(DEVICES)}")
    config = load_config(args.config, _parse_set(args.set))
    if args.nprocs > 1:
        from ms_layout.comm import run_local

        results = run_local(_rank_main, args.nprocs, backend="gloo", timeout=args.timeout,
                            args=(config.to_dict(), args.resume, not args.no_progress, args.device))  # fmt: skip
        return results[0]
    from .runtime.run import train

    _set_device(args.device)
    return train(config, None, args.resume, not args.no_progress)


def cmd_pack(args: argparse.Namespace) -> dict:
    from .packing import plan_packs

    lengths = _parse_lengths(args.lengths)
    MAX_SEQ_LEN.check(args.max_pack_len, "--max-pack-len", RLHFError)
    plan = plan_packs(lengths, args.max_pack_len, args.max_pack_count)
    if not args.json:
        print(plan)
    return {**plan.to_dict(), "token_bound": plan.token_bound, "fill": plan.fill()}


def build_parser() -> argparse.ArgumentParser:
    """The ms-rlhf argument parser."""
    parser = argparse.ArgumentParser(prog="ms-rlhf", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run GRPO from a config file")
    t.add_argument("--config", required=True, help="JSON or TOML TrainConfig")
    t.add_argument("--resume", default=None, help="a checkpoint directory, a directory with LATEST, or 'auto'")
    t.add_argument("--nprocs", type=int, default=1, help="local ranks (gloo process group)")
    t.add_argument("--timeout", type=float, default=3600.0, help="deadline of a multi-rank run (seconds)")
    t.add_argument("--device", default="CPU", help="MindSpore device (CPU, GPU, Ascend)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key: section.field (rollout.temperature=0.7), a run-wide key "
                        "(steps=50) or an earlier config's flat name (lr=0.02); VALUE: JSON or a string")  # fmt: skip
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--json", action="store_true", help="print only a JSON summary on stdout")
    p = sub.add_parser("pack", help="pack sample lengths and report the bound")
    p.add_argument("--lengths", required=True, help="comma-separated token counts")
    p.add_argument("--max-pack-len", type=int, required=True)
    p.add_argument("--max-pack-count", type=int, default=None)
    p.add_argument("--json", action="store_true")
    for command in (t, p):  # --debug after the command too; SUPPRESS keeps `ms-rlhf --debug train` working
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "train":
        # the log goes to stderr, so --json keeps stdout machine-readable
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    summary = cmd_train(args) if args.command == "train" else cmd_pack(args)
    if args.json:
        print(json.dumps(summary, indent=1, default=float))
    elif args.command == "train":
        print(json.dumps({k: v for k, v in summary.items() if k not in ("rewards", "losses", "last")}, default=float))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Bad input (a config, a checkpoint, a flag value) ends as one line ``ms-rlhf: error: ...`` and
    exit code 2; ``--debug`` shows the traceback."""
    return run_console("ms-rlhf", build_parser(), _run, argv, (RLHFError,))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
