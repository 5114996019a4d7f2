"""pytest plugin of ms-layout (entry point ``pytest11: ms_layout``).

* fixture ``run_ranks``: ``results = run_ranks(fn, nprocs=4, backend="gloo", timeout=60,
  args=(...))`` runs ``fn(group, *args)`` on local ranks (:func:`ms_layout.comm.run_local`);
  ``fn`` must be a module-level function of the test file (ranks are spawned processes).
* fixture ``shaped_network``: ``net = shaped_network(2, rate="100mbit")`` builds a
  :class:`ms_layout.comm.netns.ShapedNetwork` (each rank in its own network namespace, links shaped
  by tbf), removed after the test; ``run_ranks(fn, 2, network=net)`` runs ranks on it. The test is
  skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
* markers: ``needs_torch`` and ``needs_mindspore`` (the core-only test variant deselects them with
  ``-m "not needs_torch and not needs_mindspore"``; they are never skipped silently, so a full run
  with a broken install fails loudly), and ``ascend`` (skipped unless an Ascend device is found).
* ``assert_close(actual, expected, rtol, what)``: float32 results of the same math computed in
  another order, compared relative to the tensor's own scale; ``UNIT_ROUNDOFF`` (u = 2^-24) to
  derive ``rtol`` from.
* ``run_script(module, argv)``: run ``python -m module argv...`` in a subprocess and return its exit
  code, stdout, stderr, peak RSS and wall time (the bad-input tests of every console script).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest

UNIT_ROUNDOFF = 2.0**-24
"""float32's unit roundoff u: reordering a sum of n terms moves it by at most about n * u of the
magnitudes summed (the first-order worst case), so tolerances are multiples of it."""


def assert_close(actual, expected, rtol: float, what: str, atol: float = 0.0) -> None:
    """Assert max|actual - expected| <= rtol * scale + atol, scale = max(max|actual|, max|expected|).

    For float32 results of the same math computed in another order (pipelined vs one process,
    sharded vs whole, fused vs eager): rounding error is relative to the tensor's own scale, so a
    bare absolute tolerance passes or fails with the weights, the data and the CPU's kernels, and
    an elementwise rtol fails on entries that cancel to near zero. ``rtol`` is a multiple of
    :data:`UNIT_ROUNDOFF` derived from the accumulation length at the call site; ``atol`` only
    where a floor is justified there. The message names `what`, the error, the scale and the
    tolerance."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    if a.size == 0:
        return
    err = float(np.abs(a - e).max())
    scale = float(max(np.abs(a).max(), np.abs(e).max()))
    tol = rtol * scale + atol
    assert err <= tol, (
        f"{what}: max|actual - expected| = {err:.3g} > tolerance {tol:.3g}"
        f" (rtol {rtol:.3g} x scale {scale:.3g} + atol {atol:.3g}; error / scale = {err / scale:.3g})"
    )


MARKERS = {
    "needs_torch": "needs torch (the gloo backend); deselect with -m 'not needs_torch'",
    "needs_mindspore": "needs MindSpore; deselect with -m 'not needs_mindspore'",
    "ascend": "needs an Ascend NPU; skipped when none is present",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ascend_items = [item for item in items if item.get_closest_marker("ascend") is not None]
    if not ascend_items:
        return
    from ms_layout.comm.mindspore_backend import ascend_available

    if ascend_available():
        return
    skip = pytest.mark.skip(reason="needs an Ascend device (none found)")
    for item in ascend_items:
        item.add_marker(skip)


RunRanks = Callable[..., list]


@pytest.fixture
def run_ranks() -> RunRanks:
    """Start N local ranks and return each rank's result, in rank order."""
    from ms_layout.comm.launcher import run_local

    def run(
        fn: Callable[..., Any],
        nprocs: int = 2,
        backend: str = "gloo",
        timeout: float = 60.0,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        network: Any = None,
    ) -> list:
        return run_local(
            fn, nprocs, backend=backend, args=args, kwargs=kwargs, timeout=timeout, env=env, network=network
        )

    return run


@pytest.fixture
def shaped_network():
    """Build shaped networks for the test (skipped where they cannot be made); removed after it."""
    from ms_layout.comm.netns import ShapedNetwork, available

    ok, why = available()
    if not ok:
        pytest.skip(f"no shaped network: {why}")
    built: list[ShapedNetwork] = []

    def make(nranks: int = 2, rate: str = "1gbit", **kwargs: Any) -> ShapedNetwork:
        net = ShapedNetwork(nranks, rate=rate, **kwargs).__enter__()
        built.append(net)
        return net

    yield make
    for net in built:
        net.__exit__(None, None, None)


@dataclass(frozen=True)
class ScriptRun:
    """What one console-script run answered."""

    rc: int
    """Exit code (negative: killed by that signal)."""
    stdout: str
    stderr: str
    max_rss_mb: float
    """Peak resident memory of the child itself (from wait4, not of the test process)."""
    seconds: float

    def assert_one_line_error(self, prog: str, message: str, stdout_empty: bool = True) -> None:
        """Exit code 2, nothing on stdout, and one stderr line ``PROG: error: ...`` holding `message`."""
        assert self.rc == 2, self.stderr
        if stdout_empty:
            assert self.stdout == "", self.stdout
        lines = self.stderr.splitlines()
        assert len(lines) == 1, self.stderr
        assert lines[0].startswith(f"{prog}: error: "), lines[0]
        assert message in lines[0], (message, lines[0])
        assert "Traceback" not in self.stderr


# Runs the script and reports its own rusage. Linux carries a forked child's peak RSS (the copy of the
# parent's pages) over its exec, so a script forked straight from pytest would report pytest's peak;
# forked from this small launcher it reports its own (plus the launcher's few MB).
_LAUNCHER = """
import os, subprocess, sys, time
report, timeout, cmd = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
proc = subprocess.Popen(cmd)
start = time.monotonic()
while True:
    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    if pid:
        break
    if time.monotonic() - start > timeout:
        proc.kill()
        pid, status, usage = os.wait4(proc.pid, 0)
        break
    time.sleep(0.005)
seconds = time.monotonic() - start
proc.returncode = os.waitstatus_to_exitcode(status)
with open(report, "w") as f:
    f.write(f"{proc.returncode} {usage.ru_maxrss} {seconds}")
"""


def run_script(
    module: str,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    cwd: str | None = None,
) -> ScriptRun:
    """Run ``python -m module *argv`` with this interpreter (the environment inherited, PYTHONPATH
    included, plus `env`) and return what it answered, with the peak RSS (``wait4``, Linux) and the
    wall time of that process alone. A run over `timeout` seconds is killed (rc -9)."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("MS_TOOLKIT_DEBUG", None)
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "rusage")
        with open(os.path.join(tmp, "out"), "wb+") as out, open(os.path.join(tmp, "err"), "wb+") as err:
            cmd = [sys.executable, "-c", _LAUNCHER, report, str(timeout), sys.executable, "-m", module, *argv]
            subprocess.run(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=full_env, cwd=cwd, check=True)
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        with open(report) as f:
            rc, rss_kb, seconds = f.read().split()
    return ScriptRun(int(rc), stdout, stderr, int(rss_kb) / 1024, float(seconds))
