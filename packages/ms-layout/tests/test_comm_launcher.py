"""run_local: results in rank order, and failures reported promptly with the failing rank named,
while the other ranks sit in a collective waiting for it; no process survives a run."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from ms_layout.comm import CommError, RankFailedError, run_local
from ms_layout.testing import run_ranks  # noqa: F401  (also provided by the pytest plugin)

pytestmark = pytest.mark.needs_torch

# "Promptly" is measured against a run of the same size that fails nowhere, timed just before on the
# same machine (start-up, rendezvous and exit of its ranks: ~2 s on a quiet box, several times that
# under load), not against a fixed number of seconds. A run that waited for its whole-run timeout
# instead would take RUN_TIMEOUT_S, far beyond that bound (which is capped at half of it).
RUN_TIMEOUT_S = 300


def prompt_bound(healthy_s: float) -> float:
    """Seconds a failing run may take: three healthy runs and 10 s (the failing rank's 0.5 s sleep,
    killing and reaping the others), and never half the run's timeout."""
    return min(3 * healthy_s + 10, RUN_TIMEOUT_S / 2)


def report(g, scale, *, offset=0):
    a = np.full(3, float(g.rank + 1))
    g.all_reduce(a)
    env = (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ.get("MS_LAYOUT_TEST_VAR"))
    return g.rank, a[0] * scale + offset, env, os.getpid(), g.backend


def raise_on_rank_1(g):
    if g.rank == 1:
        time.sleep(0.5)  # the others are in all_reduce by now
        raise ValueError("boom from rank 1")
    g.all_reduce(np.ones(4))  # waits for rank 1 forever (well, until killed)


def exit_on_rank_2(g):
    if g.rank == 2:
        time.sleep(0.5)
        os._exit(3)
    g.barrier()


def barrier(g):
    g.barrier()
    return g.rank


@pytest.fixture
def healthy_s():
    """Seconds a 3-rank gloo run that fails nowhere takes, right now on this machine."""
    start = time.monotonic()
    assert run_local(barrier, 3, backend="gloo", timeout=RUN_TIMEOUT_S) == [0, 1, 2]
    return time.monotonic() - start


def sleep_on_rank_1(g):
    if g.rank == 1:
        time.sleep(3600)
    return g.rank


def leave_a_grandchild(g):
    # rank 0 starts a long-lived subprocess, reports its pid, then fails: the launcher must kill it
    if g.rank == 0:
        child = subprocess.Popen(["sleep", "600"])
        raise RuntimeError(f"grandchild pid {child.pid}")
    g.barrier()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_results_in_rank_order(run_ranks):  # noqa: F811
    results = run_ranks(
        report,
        nprocs=3,
        backend="auto",  # gloo, without an Ascend device
        timeout=60,
        args=(10.0,),
        kwargs={"offset": 1},
        env={"MS_LAYOUT_TEST_VAR": "x"},
    )
    assert [r[:3] for r in results] == [(rank, 61.0, (str(rank), "3", "x")) for rank in range(3)]
    assert {r[4] for r in results} == {"gloo"}
    pids = [r[3] for r in results]
    assert len(set(pids)) == 3 and not any(_alive(p) for p in pids)


def test_raising_rank_is_named_promptly(healthy_s):
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_local(raise_on_rank_1, 3, backend="gloo", timeout=RUN_TIMEOUT_S)
    elapsed = time.monotonic() - start
    assert info.value.rank == 1
    assert "ValueError: boom from rank 1" in info.value.detail
    assert "Traceback" in info.value.detail and "raise_on_rank_1" in info.value.detail
    assert elapsed < prompt_bound(healthy_s), (elapsed, healthy_s)


def test_exiting_rank_is_named_promptly(healthy_s):
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 2 failed") as info:
        run_local(exit_on_rank_2, 3, backend="gloo", timeout=RUN_TIMEOUT_S)
    assert "exited with code 3 without returning a result" in info.value.detail
    elapsed = time.monotonic() - start
    assert elapsed < prompt_bound(healthy_s), (elapsed, healthy_s)


def test_whole_run_timeout_names_the_stuck_rank(healthy_s):
    # the timeout must leave rank 0 time to start and return (else both ranks are named): at least
    # 6 s, more when this machine is slow right now; the run then ends at the timeout, give or take
    # the killing (10 s slack), not when rank 1's hour-long sleep ends
    timeout = max(6, round(2 * healthy_s))
    start = time.monotonic()
    with pytest.raises(CommError, match=rf"timed out after {timeout} s: ranks \[1\] did not finish"):
        run_local(sleep_on_rank_1, 2, backend="gloo", timeout=timeout)
    elapsed = time.monotonic() - start
    assert elapsed < timeout + 10, (elapsed, timeout)


def test_no_orphans_after_a_failure():
    with pytest.raises(RankFailedError) as info:
        run_local(leave_a_grandchild, 2, backend="gloo", timeout=60)
    pid = int(info.value.detail.rsplit("grandchild pid ", 1)[1].split()[0])
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def affinities(g):
    """This rank's CPU set, and that of a thread it starts after the launcher pinned it."""
    import threading

    seen = []
    t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
    t.start()
    t.join()
    return os.sched_getaffinity(0), seen[0]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_pin_cpus_gives_each_rank_one_cpu_of_the_launchers_set():
    cpus = sorted(os.sched_getaffinity(0))
    nprocs = len(cpus) + 1  # one more rank than CPUs: the last one wraps around to the first CPU
    results = run_local(affinities, nprocs, backend="gloo", timeout=RUN_TIMEOUT_S, pin_cpus=True)
    assert results == [({cpus[r % len(cpus)]},) * 2 for r in range(nprocs)]
    unpinned = run_local(affinities, 2, backend="gloo", timeout=RUN_TIMEOUT_S)
    assert unpinned == [(set(cpus), set(cpus))] * 2


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_pin_cpus_must_be_a_bool(bad):
    with pytest.raises(CommError, match=f"pin_cpus must be True or False, got {bad!r}"):
        run_local(barrier, 2, backend="gloo", pin_cpus=bad)


def test_the_forkserver_preloads_start_no_thread():
    """A fork keeps only the forking thread: a preloaded module that started a thread at import
    (a pool, a watcher) would leave the ranks with its state and without the thread."""
    from ms_layout.comm.launcher import PRELOAD

    pytest.importorskip("mindspore")
    code = (
        "import os, sys, importlib\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "for m in sys.argv[1:]: importlib.import_module(m)\n"
        "print(before, len(os.listdir('/proc/self/task')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *PRELOAD], capture_output=True, text=True, check=True, timeout=120
    )
    before, after = map(int, out.stdout.split())
    assert "mindspore" in PRELOAD and after == before, out.stdout
