"""pytest plugin of ms-layout (entry point ``pytest11: ms_layout``).

* fixture ``run_ranks``: ``results = run_ranks(fn, nprocs=4, backend="gloo", timeout=60,
  args=(...))`` runs ``fn(group, *args)`` on local ranks (:func:`ms_layout.comm.run_local`);
  ``fn`` must be a module-level function of the test file (ranks are spawned processes).
* markers: ``needs_torch`` and ``needs_mindspore`` (the core-only test variant deselects them with
  ``-m "not needs_torch and not needs_mindspore"``; they are never skipped silently, so a full run
  with a broken install fails loudly), and ``ascend`` (skipped unless an Ascend device is found).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

import pytest

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
