"""The ``ms-monitor`` console script: ``daemon``, ``status``, ``trace``."""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlparse

from ms_layout.console import run_console
from ms_layout.files import atomic_write, atomic_write_json

from . import auth, wire
from .detect import DetectorConfig
from .errors import MonitorError

URL_ENV = "MS_MONITOR_URL"
DEFAULT_URL = "http://127.0.0.1:7780"


def parse_ranks(text: str) -> list[int]:
    """``"0-3,6"`` -> [0, 1, 2, 3, 6]."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not (lo.isascii() and lo.isdigit()) or (sep and not (hi.isascii() and hi.isdigit())):
            raise MonitorError(f"--ranks {text!r}: {part!r} is not N or N-M")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise MonitorError(f"--ranks {text!r}: {part!r} is an empty range")
        wire.MAX_RANK.check(b, f"--ranks {text!r}: rank", MonitorError)
        if len(out) + b - a >= 1 << 16:
            raise MonitorError(f"--ranks {text!r} names more than 65536 ranks")
        out.update(range(a, b + 1))
    return sorted(out)


def check_url(url: str) -> str:
    """``url`` without a trailing slash, if it is an http(s)://HOST[:PORT] address."""
    parts = urlparse(url)
    try:
        parts.port  # noqa: B018 -- raises for a port that is not a number in 0..65535
    except ValueError:
        raise MonitorError(f"--url {url!r} has a port that is not a number in 1..65535") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MonitorError(f"--url {url!r} is not an http://HOST:PORT address")
    return url.rstrip("/")


def _fields(doc: Any, keys: tuple[str, ...], url: str) -> Any:
    if not isinstance(doc, dict) or any(k not in doc for k in keys):
        raise MonitorError(f"{url} did not answer as an ms-monitor daemon (expected the keys {list(keys)})")
    return doc


def _request(url: str, body: dict | None = None, token: str | None = None, timeout: float = 15.0) -> Any:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except ValueError as exc:  # not JSON (another server on that port), or a URL urllib cannot use
        raise MonitorError(f"{url}: {exc}") from None
    except http.client.HTTPException as exc:  # not HTTP at all
        raise MonitorError(f"{url}: not an HTTP answer ({type(exc).__name__}: {exc})") from None
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("error", detail)
        except ValueError:
            pass
        raise MonitorError(f"{url}: HTTP {exc.code}: {detail}") from None
    except urllib.error.URLError as exc:
        raise MonitorError(f"cannot reach the daemon at {url}: {exc.reason}") from None


def cmd_daemon(args: argparse.Namespace) -> int:
    from .daemon import Daemon, DaemonConfig

    detector = DetectorConfig(
        slow_ratio=args.slow_ratio,
        slow_steps=args.slow_steps,
        slow_excess_seconds=args.slow_excess,
        slow_window=args.slow_window,
        slow_window_ratio=args.slow_window_ratio,
        slow_window_fraction=args.slow_window_fraction,
        slow_window_spread=args.slow_window_spread,
        regress_ratio=args.regress_ratio,
        jitter_cv=args.jitter_cv,
    )
    limits = {k: getattr(args, k) for k in ("max_ranks", "max_connections", "http_timeout") if getattr(args, k)}
    cfg = DaemonConfig(
        host=args.host,
        port=None if args.port == -1 else args.port,
        unix=args.unix,
        http_host=args.http_host,
        http_port=None if args.http_port == -1 else args.http_port,
        token=args.token or os.environ.get(auth.TOKEN_ENV),
        token_file=args.token_file,
        allow_local_unauthenticated=args.allow_local_unauthenticated,
        http_allow_hosts=tuple(args.http_allow_host),
        forward=args.forward,
        jsonl=args.jsonl,
        tensorboard=args.tensorboard,
        window=args.window,
        detector=detector,
        clean_shm=not args.keep_stale_shm,
        **limits,
        **({"trace_dir": args.trace_dir} if args.trace_dir else {}),
    )
    daemon = Daemon(cfg)

    def ready() -> None:
        info = {"agents": daemon.agent_addrs, "http": daemon.http_url, "pid": os.getpid()}
        info["token_file"] = daemon.token_file
        text = f"ms-monitor daemon: agents {daemon.agent_addrs}, http {daemon.http_url}"
        print(json.dumps(info) if args.json else text, flush=True)
        if args.ready_file:
            atomic_write_json(args.ready_file, info)

    import asyncio

    try:
        asyncio.run(daemon.serve(ready))
    except KeyboardInterrupt:
        pass
    except OSError as exc:  # a port in use, a socket path not writable
        raise MonitorError(f"the daemon cannot listen: {exc.strerror or exc}") from None
    except OverflowError as exc:  # a port number the system refuses
        raise MonitorError(f"the daemon cannot listen: {exc}") from None
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    url = check_url(args.url) + "/api/status"
    status = _fields(_request(url), ("ranks", "alerts", "active_alerts", "received", "traces"), url)
    if args.json:
        print(json.dumps({k: status[k] for k in ("ranks", "alerts", "active_alerts", "received", "traces")}, indent=1))
        return 0
    print(f"{len(status['ranks'])} ranks, {status['received']} samples received")
    print(f"{'rank':>5} {'role':>6} {'host':>14} {'last step':>10} {'step ms':>9} {'median ms':>10} {'dropped':>8}")
    for r in status["ranks"]:
        st = r.get("step_time")
        med = r.get("step_time_median")
        print(
            f"{r['rank']:>5} {r['role']:>6} {r['host'][:14]:>14} {r['last_step']:>10} "
            f"{'-' if st is None else f'{st * 1e3:.1f}':>9} {'-' if med is None else f'{med * 1e3:.1f}':>10} "
            f"{r['agent_dropped']:>8}"
        )
    active = status["active_alerts"]
    print(f"{len(active)} active alerts" + (":" if active else ""))
    for a in active:
        print(f"  {a['kind']:<11} rank {a['rank']} since step {a['step']}: {a['message']}")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    base = check_url(args.url)
    if not 1 <= args.steps <= 100000:
        raise MonitorError(f"--steps {args.steps} is not a number of steps in 1..100000")
    if not 0 < args.timeout <= 86400:
        raise MonitorError(f"--timeout {args.timeout:g} is not a number of seconds in (0, 86400]")
    req = {
        "ranks": parse_ranks(args.ranks) if args.ranks else None,
        "steps": args.steps,
        "start_step": args.start_step,
        "profiler": not args.no_profiler,
        "analyse": args.analyse,
        "timeout": args.timeout,
    }
    token = args.token or auth.token_for_url(base, args.token_file)
    keys = ("id", "state", "start_step", "steps", "expected", "dyno_ranks", "errors", "path", "sources")
    job = _fields(_request(base + "/api/trace", req, token=token), keys, base + "/api/trace")
    if not args.json:
        print(
            f"trace {job['id']}: steps {job['start_step']}..{job['start_step'] + job['steps'] - 1} "
            f"on ranks {job['expected']}"
            + (f", MindSpore dyno ranks {job['dyno_ranks']}" if job["dyno_ranks"] else ""),
            file=sys.stderr,
        )
    deadline = time.monotonic() + args.timeout + 30
    while job["state"] == "running":
        if time.monotonic() > deadline:
            raise MonitorError(f"trace {job['id']} still running after {args.timeout + 30:.0f} s")
        time.sleep(0.5)
        job = _fields(_request(f"{base}/api/trace/{job['id']}"), keys, base + "/api/trace")
    if job["state"] != "done":
        raise MonitorError(f"trace {job['id']} {job['state']}: {job['errors']}")
    if args.out:
        req_ = urllib.request.Request(f"{base}/api/trace/{job['id']}/merged")
        with urllib.request.urlopen(req_, timeout=60) as resp:
            data = resp.read()
        atomic_write(args.out, data)
        job["out"] = os.path.abspath(args.out)
    if args.json:
        print(json.dumps(job, indent=1))
    else:
        print(f"merged trace of ranks {sorted(int(r) for r in job['sources'])}: {job.get('out') or job['path']}")
        for rank, err in job["errors"].items():
            print(f"  rank {rank}: {err}")
    return 0


def _debug_flag(parser: argparse.ArgumentParser) -> None:
    # also after the sub-command; SUPPRESS keeps it from resetting a --debug given before it
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ms-monitor", description="Training performance monitoring for MindSpore jobs")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("daemon", help="run the node daemon (or a cluster aggregator)")
    d.add_argument("--host", default="127.0.0.1", help="agent listener host (default loopback)")
    d.add_argument("--port", type=int, default=7781, help="agent TCP port (0: any, -1: none)")
    d.add_argument("--unix", help="also listen for agents on this Unix socket path")
    d.add_argument("--http-host", default="127.0.0.1")
    d.add_argument("--http-port", type=int, default=7780, help="dashboard/metrics/API port (0: any, -1: none)")
    d.add_argument("--token", help="shared secret (or MS_MONITOR_TOKEN); required beyond loopback")
    d.add_argument(
        "--token-file",
        help="where a daemon without --token writes the token it makes, mode 0600 "
        "(default $MS_MONITOR_STATE_DIR or ~/.cache/ms-monitor, file token-<http port>)",
    )
    d.add_argument(
        "--allow-local-unauthenticated",
        action="store_true",
        help="accept HTTP commands (trace) from loopback clients without the token",
    )
    d.add_argument("--http-allow-host", action="append", default=[], help="a further name accepted in the Host header")
    d.add_argument("--max-ranks", type=int, help="ranks tracked at most (default $MS_MONITOR_MAX_RANKS or 4096)")
    d.add_argument(
        "--max-connections", type=int, help="agent connections at most (default $MS_MONITOR_MAX_CONNECTIONS or 1024)"
    )
    d.add_argument("--http-timeout", type=float, help="seconds an HTTP client may stay silent (default 10)")
    d.add_argument("--forward", help="relay samples to a cluster aggregator at tcp:HOST:PORT")
    d.add_argument("--trace-dir", help="where merged traces are written")
    d.add_argument("--jsonl", help="append samples and alerts to this JSON-lines file")
    d.add_argument("--tensorboard", help="write TensorBoard scalars under this directory")
    d.add_argument("--window", type=int, default=600, help="samples kept per rank")
    d.add_argument(
        "--keep-stale-shm",
        action="store_true",
        help="do not remove /dev/shm/DynamicProfileShm* segments that no live process maps (left by killed jobs)",
    )
    dc = DetectorConfig()
    d.add_argument("--slow-ratio", type=float, default=dc.slow_ratio, help="busy / peers' median of a slow step")
    d.add_argument(
        "--slow-steps", type=int, default=dc.slow_steps, help="slow steps in a row that raise (longer than a burst)"
    )
    d.add_argument(
        "--slow-excess",
        type=float,
        default=dc.slow_excess_seconds,
        help="... once their busy seconds over the peers' median add up to this (big stragglers, raised fast)",
    )
    d.add_argument(
        "--slow-window",
        type=int,
        default=dc.slow_window,
        help="steps of the persistent-straggler test (small stragglers, 0: off); it raises when the busy time "
        "was >= --slow-window-ratio x the peers' median in --slow-window-fraction of them",
    )
    d.add_argument("--slow-window-ratio", type=float, default=dc.slow_window_ratio)
    d.add_argument("--slow-window-fraction", type=float, default=dc.slow_window_fraction)
    d.add_argument(
        "--slow-window-spread",
        type=float,
        default=dc.slow_window_spread,
        help="... with steady ratios: median over lower quartile of the window at most this",
    )
    d.add_argument("--regress-ratio", type=float, default=1.3)
    d.add_argument("--jitter-cv", type=float, default=0.35)
    d.add_argument("--ready-file", help="write the bound addresses as JSON to this file once listening")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=cmd_daemon)
    _debug_flag(d)

    url = os.environ.get(URL_ENV, DEFAULT_URL)
    s = sub.add_parser("status", help="ranks, their last step, and alerts")
    s.add_argument("--url", default=url, help=f"daemon HTTP address (default ${URL_ENV} or {DEFAULT_URL})")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)
    _debug_flag(s)

    t = sub.add_parser("trace", help="capture N steps of the running job on some ranks, merged into one trace")
    t.add_argument("--ranks", help="e.g. 0-3 or 0,2 (default: all)")
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--start-step", type=int, help="first step to capture (default: a few steps ahead)")
    t.add_argument("--out", help="write the merged Chrome trace here")
    t.add_argument("--no-profiler", action="store_true", help="agent ranges only, no MindSpore profiler")
    t.add_argument(
        "--analyse",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run MindSpore's analysis to get trace_view.json (default: agents yes, dyno no)",
    )
    t.add_argument("--timeout", type=float, default=180.0)
    t.add_argument("--url", default=url)
    t.add_argument("--token", help="the daemon's token (default $MS_MONITOR_TOKEN, then its token file)")
    t.add_argument("--token-file", help="read the token from this file")
    t.add_argument("--json", action="store_true")
    t.set_defaults(fn=cmd_trace)
    _debug_flag(t)
    return p


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO if args.verbose or args.command == "daemon" else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
    )
    return args.fn(args)


def main(argv: list[str] | None = None) -> int:
    return run_console("ms-monitor", build_parser(), _run, argv, (MonitorError,))


if __name__ == "__main__":
    sys.exit(main())
