"""pytest plugin of ms-layout (entry point ``pytest11: ms_layout``).

* fixture ``run_ranks``: ``results = run_ranks(fn, nprocs=4, backend="gloo", timeout=60,
  args=(...))`` runs ``fn(group, *args)`` on local ranks (:func:`ms_layout.comm.run_local`);
  ``fn`` must be a module-level function of the test file (ranks are spawned processes).
* markers: ``needs_torch`` and ``needs_mindspore`` (the core-only test variant deselects them with
  ``-m "not needs_torch and not needs_mindspore"``; they are never skipped silently, so a full run
  with a broken install fails loudly), and ``ascend`` (skipped unless an Ascend device is found).
* ``assert_close(actual, expected, rtol, what)``: float32 results of the same math computed in
  another order, compared relative to the tensor's own scale; ``UNIT_ROUNDOFF`` (u = 2^-24) to
  derive ``rtol`` from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    ) -> list:
        return run_local(fn, nprocs, backend=backend, args=args, kwargs=kwargs, timeout=timeout, env=env)

    return run
