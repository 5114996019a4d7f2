"""Run a function on N local ranks, each a fresh process.

Ranks are started like multiprocessing's "spawn" (a clean interpreter; ``fn`` is pickled by
reference, so it must be importable), but through the "forkserver" start method where the platform
has it, with numpy, torch and MindSpore preloaded in the server: measured on 2 busy cores, starting
4 ranks that import torch took 10-26 s with spawn and 0.2-0.4 s from the warm forkserver (3.5 s
cold); importing MindSpore costs each rank ~9 s of CPU more, and preloading it took ms-pipeline's
three runtime tests (2 and 4 ranks) from 172 to 138 s. Importing MindSpore starts no thread (its
thread pools start with the first op), so forking after it is safe.

``pin_cpus=True`` gives rank r the r-th CPU of the launcher's own CPU set (modulo its size), set
before the rank starts any thread, so that every thread it starts (MindSpore's kernel threads,
OpenMP, BLAS) stays on that CPU. Unpinned, each rank's threads float over every core and the ranks
slow each other down: measured with a 2-rank ZeroBubbleV pipeline on 2 cores, its step went from
1.33x to 1.155x of 1F1B's when pinned (one run each, same code).

Each rank gets a torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), calls ``ms_layout.comm.init(backend)`` and runs ``fn(group, *args, **kwargs)``. The
return values travel back over a multiprocessing pipe (pickle between our own parent and child,
never from disk or a network peer).

Failure handling, which is the point of this module:
* the first rank to raise (or to exit without a result: ``os._exit``, a signal) is reported as
  :class:`RankFailedError` with its traceback or exit status, and the other ranks -- typically
  stuck in a collective waiting for it -- are killed at once, not after the run timeout;
* the whole run has a deadline; past it the unfinished ranks are killed and named in a CommError;
* each rank runs in its own process group, killed as a group, and watches its parent: if the
  parent dies, the rank kills itself, so no orphan survives either side;
* ranks initialise with a finite collective timeout, so even outside this launcher a dead peer
  turns into an error rather than a hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from importlib.util import find_spec
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from ms_layout.comm.env import MSRUN_VARS, free_port
from ms_layout.comm.protocol import CommArgumentError
from ms_layout.errors import CommError, RankFailedError

#: the ranks' own collective timeout exceeds the run's by this much, so that a stuck run is
#: reported by the launcher's deadline (naming the ranks) rather than by a rank's gloo timeout
RANK_TIMEOUT_MARGIN_S = 5.0
#: after every rank returned, how long their normal exit may take before they are killed
EXIT_GRACE_S = 10.0


#: modules the forkserver imports once, so that every rank starts with them loaded (none of them
#: starts a thread at import, which a fork would not carry over)
PRELOAD = ("numpy", "torch.distributed", "ms_layout.comm.gloo", "mindspore")


def _context() -> Any:
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # only what is installed (a failed preload is skipped anyway); ignored once the server runs
    ctx.set_forkserver_preload([m for m in PRELOAD if find_spec(m.split(".")[0]) is not None])
    return ctx


def _watch_parent(parent_pid: int) -> None:
    """Daemon thread in each rank: when its parent (the launcher, or the forkserver, which exits
    with the launcher) dies, take this rank's process group down too."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            try:
                if os.getpgrp() == os.getpid():  # only our own group, never the launcher's
                    os.killpg(0, signal.SIGKILL)
            finally:
                os._exit(70)


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    backend: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    rank_env: Mapping[str, str],
    timeout: float,
    conn: Connection,
) -> None:
    """Entry point of one rank (runs in the child)."""
    if rank_env.get("MS_LAYOUT_CPUS"):  # before any import starts a thread pool
        os.sched_setaffinity(0, {int(rank_env["MS_LAYOUT_CPUS"])})
    if rank_env.get("MS_LAYOUT_NETNS"):  # a shaped network: into this rank's namespace first
        from ms_layout.comm.netns import enter

        enter(rank_env["MS_LAYOUT_NETNS"])
    try:
        os.setpgrp()  # so the launcher can kill this rank and anything it started, together
    except OSError:
        pass
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    for name in MSRUN_VARS:  # we are not an msrun worker, even if the launcher runs under msrun
        os.environ.pop(name, None)
    os.environ.update(rank_env)
    ok, group = False, None
    try:
        from ms_layout import comm

        group = comm.init(backend, timeout=timeout)
        payload: tuple = ("ok", rank, fn(group, *args, **dict(kwargs)), time.time())
        ok = True
    except BaseException:
        payload = ("err", rank, traceback.format_exc(), time.time())
    try:
        conn.send(payload)
    except Exception:
        ok = False
        conn.send(("err", rank, "could not send the result back:\n" + traceback.format_exc(), time.time()))
    conn.close()
    if ok and group is not None:
        # No rank leaves while a peer may still be reading what it sent asynchronously.
        try:
            group.barrier()
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    if ok and group is not None and group.backend == "gloo":
        from ms_layout import comm

        try:
            comm.destroy()  # then a normal exit (lets coverage and atexit hooks run)
        except Exception:
            pass
        return
    # MindSpore's interpreter teardown can stall for tens of seconds (measured 30 s after a
    # failed op); a failed rank has nothing left to flush either.
    os._exit(0 if ok else 1)


def _kill(procs: Sequence[Any]) -> None:
    """SIGKILL each rank's process group (the rank and anything it started), then reap."""
    for p in procs:
        if p.pid is None:
            continue
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            if p.is_alive():
                p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5)


def _exit_detail(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def run_local(
    fn: Callable[..., Any],
    nprocs: int,
    *,
    backend: str = "gloo",
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    network: Any = None,
    pin_cpus: bool = False,
) -> list[Any]:
    """Run ``fn(group, *args, **kwargs)`` on ``nprocs`` local ranks; return the results in rank
    order. ``fn`` must be picklable (a module-level function). ``env`` adds variables to every
    rank; ``network`` (an entered :class:`ms_layout.comm.netns.ShapedNetwork` of at least
    ``nprocs`` ranks) runs each rank in its own namespace over the shaped links; ``pin_cpus``
    pins rank r to CPU r of this process's CPU set (modulo its size; see the module docstring).
    Raises RankFailedError for the first failing rank, CommError on timeout."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise CommArgumentError(f"nprocs must be a positive int, got {nprocs!r}")
    if backend not in ("auto", "gloo", "mindspore"):
        raise CommArgumentError(f"unknown backend {backend!r}; expected 'auto', 'gloo' or 'mindspore'")
    if not timeout > 0:
        raise CommArgumentError(f"timeout must be positive, got {timeout!r}")
    if network is not None and (not network.up or network.nranks < nprocs):
        raise CommArgumentError(f"network {network!r} is not up or has fewer than {nprocs} ranks")
    if not isinstance(pin_cpus, bool):
        raise CommArgumentError(f"pin_cpus must be True or False, got {pin_cpus!r}")
    if pin_cpus and not hasattr(os, "sched_setaffinity"):
        raise CommArgumentError("pin_cpus=True needs os.sched_setaffinity, which this platform lacks")
    cpus = sorted(os.sched_getaffinity(0)) if pin_cpus else []
    ctx = _context()
    port = free_port()
    procs: list[Any] = []
    conns: dict[Connection, int] = {}
    deadline = time.monotonic() + timeout
    try:
        for rank in range(nprocs):
            rank_env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(nprocs),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                **dict(env or {}),
                **(network.rank_env(rank) if network is not None else {}),
                **({"MS_LAYOUT_CPUS": str(cpus[rank % len(cpus)])} if cpus else {}),
            }
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main,
                args=(
                    fn,
                    rank,
                    backend,
                    tuple(args),
                    dict(kwargs or {}),
                    rank_env,
                    timeout + RANK_TIMEOUT_MARGIN_S,
                    writer,
                ),
                name=f"ms-layout-rank{rank}",
            )
            p.start()
            writer.close()
            procs.append(p)
            conns[reader] = rank
        results = _collect(procs, conns, deadline, timeout)
        for p in procs:  # every rank answered: give them a moment to exit cleanly
            p.join(timeout=max(0.0, min(EXIT_GRACE_S, deadline - time.monotonic())))
        return results
    finally:
        _kill(procs)
        for c in conns:
            c.close()


def _collect(procs: list[Any], conns: dict[Connection, int], deadline: float, timeout: float) -> list:
    """Wait for every rank's message; on the first failure or at the deadline, raise."""
    results: dict[int, Any] = {}
    pending = set(range(len(procs)))
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
    reader_of = {rank: c for c, rank in conns.items()}
    open_conns = set(conns)

    def read(conn: Connection, failures: list) -> None:
        try:
            kind, rank, payload, stamp = conn.recv()
        except (EOFError, OSError):
            open_conns.discard(conn)
            return
        if kind == "ok":
            results[rank] = payload
            pending.discard(rank)
        else:
            failures.append((stamp, rank, payload))

    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            done = sorted(results)
            raise CommError(
                f"run_local timed out after {timeout:g} s: ranks {sorted(pending)} did not finish"
                f" (ranks {done} returned); they were killed"
            )
        watch = list(open_conns) + [s for s, r in sentinels.items() if r in pending]
        failures: list[tuple[float, int, str]] = []
        for obj in wait(watch, timeout=remaining):
            if obj in open_conns:
                read(obj, failures)  # type: ignore[arg-type]
                continue
            rank = sentinels.pop(obj)  # type: ignore[arg-type]
            conn = reader_of[rank]
            while rank in pending and conn in open_conns and conn.poll():
                read(conn, failures)  # the result may still sit in the pipe after the exit
            if rank in pending and not any(f[1] == rank for f in failures):
                procs[rank].join(timeout=1)
                detail = f"{_exit_detail(procs[rank].exitcode)} without returning a result"
                failures.append((time.time(), rank, detail))
        if failures:
            _, rank, detail = min(failures)  # the earliest failure is the cause
            _kill(procs)
            raise RankFailedError(rank, detail)
    return [results[r] for r in range(len(procs))]


def launch_from_env(
    fn: Callable[..., Any], *args: Any, backend: str = "auto", timeout: float = 300.0, **kwargs: Any
) -> Any:
    """For scripts started by msrun, torchrun or any launcher that sets the rank environment:
    ``init(backend)`` then ``fn(group, *args, **kwargs)``. In msrun's scheduler process this
    never returns (see :mod:`ms_layout.comm`)."""
    from ms_layout import comm

    return fn(comm.init(backend, timeout=timeout), *args, **kwargs)
