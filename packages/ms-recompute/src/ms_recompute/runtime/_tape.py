"""The one place that touches MindSpore internals: switching the PyNative tape on during a backward.

A recompute re-runs a layer's forward while the backward is running, and the ops must save their
tensors again (that is what the backward reads), so recording has to be on. MindSpore has no public
switch for this; its own non-reentrant recompute (``mindspore/common/recompute.py``,
``_RecomputeHandle.recompute``) flips these same executor flags and brackets the run in an empty
graph, so the recompute's own tape is never joined to the running backward. We do exactly that,
and check at import that the executor still offers these methods, so a MindSpore that renames them
fails here with a clear message rather than somewhere inside a backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import mindspore as ms

from ..errors import RecomputeError

try:  # the executor object MindSpore's own recompute uses (mindspore 2.7 - 2.10)
    from mindspore.graph.api import _pynative_executor as _EXECUTOR
except ImportError:  # pragma: no cover - older layout
    from mindspore.common.api import _pynative_executor as _EXECUTOR

_NEEDED = ("grad_flag", "set_grad_flag", "enable_grad", "set_enable_grad", "new_empty_graph", "end_empty_graph")
_missing = [name for name in _NEEDED if not hasattr(_EXECUTOR, name)]
if _missing:  # pragma: no cover - depends on the MindSpore build
    raise RecomputeError(
        f"mindspore {ms.__version__} lacks PyNative executor methods {_missing} that recompute needs"
        " (the ones mindspore.recompute(use_reentrant=False) uses in 2.7-2.10)"
    )


def grad_enabled() -> bool:
    """Whether ops run now are recorded for a backward (False inside no-grad regions)."""
    return bool(_EXECUTOR.enable_grad())


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Record ops (so they call saved-tensor hooks) into a throw-away graph, even inside a backward."""
    flag, enabled = _EXECUTOR.grad_flag(), _EXECUTOR.enable_grad()
    _EXECUTOR.set_grad_flag(True)
    _EXECUTOR.set_enable_grad(True)
    _EXECUTOR.new_empty_graph()
    try:
        yield
    finally:
        _EXECUTOR.end_empty_graph()
        _EXECUTOR.set_grad_flag(flag)
        _EXECUTOR.set_enable_grad(enabled)
