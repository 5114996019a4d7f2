"""A stage whose blocks include some that bring their own passes, chained block by block in Python.

A block with ``pipeline_passes()`` (a tensor-parallel layer stack, whose collectives sit between
compiled segments, as ms-recompute's ``TPStackBlock``) cannot join the stage's one compiled graph
per pass. Such a stage runs as a chain of segments: each run of consecutive ordinary blocks is one
segment compiled from their explicit passes (as :class:`~.backward.ExplicitPasses` compiles a whole
stage), each block with passes of its own is a segment by itself. A segment, and the object a
block's ``pipeline_passes()`` returns, offers:

* ``weights() -> list[Parameter]``
* ``forward(*args) -> (out, kept)``: ``args`` are ``(x,)``, or ``(x, labels)`` for the last
  segment of the last stage;
* ``backward_input(kept, g) -> (dx, pairs)``: the input gradient (B) and what W needs;
* ``backward_weight(pairs) -> grads``: numpy arrays in ``weights()`` order (W);
* ``backward_full(kept, g) -> (dx, grads)``: both at once (BW);
* optionally ``forward_steps``, ``backward_input_steps``, ``backward_full_steps``: the same passes
  as generators that yield a label right after issuing each collective and return the result, so
  that :func:`~ms_pipeline.runtime.interleave_layers` can run the two halves of a 1B1F pair layer
  by layer, each one's collective in flight while the other computes.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import mindspore as ms
import numpy as np

from ..errors import ScheduleError
from .backward import ExplicitPasses, _call, _mutable_args, _PassesCell, _wait, one_dtype, split_flat


def own_passes(block: Any) -> bool:
    """The block brings its own passes (``pipeline_passes()``)."""
    return callable(getattr(block, "pipeline_passes", None))


class GraphSegment:
    """Consecutive blocks with explicit passes as one segment: one compiled graph per pass (or
    PyNative), W on the host's BLAS with ``host_w``."""

    def __init__(self, blocks: Sequence[ms.nn.Cell], last: bool, jit: bool, host_w: bool | None):
        missing = [type(b).__name__ for b in blocks if not callable(getattr(b, "explicit_passes", None))]
        if missing:
            raise ScheduleError(f"blocks {missing} have neither explicit_passes() nor pipeline_passes()")
        self.cell = _PassesCell([b.explicit_passes() for b in blocks], last, [False] * len(blocks))
        self.jit = jit
        if host_w and self.cell.host_kernels is None:
            raise ScheduleError("host_w=True needs host_kernels on every block's explicit passes")
        self.host_w = bool(host_w)
        self.flat = one_dtype(self.weights())  # W and BW return the gradients joined (see backward._flat)
        self._fns: dict[str, Any] = {}

    def _fn(self, what: str) -> Any:
        if what not in self._fns:
            fn = _call(self.cell, what)
            self._fns[what] = _mutable_args(ms.jit(fn)) if self.jit else fn
        return self._fns[what]

    def weights(self) -> list[ms.Parameter]:
        return [p for c in self.cell.passes for p in c.weights()]

    def forward(self, *args: Any) -> tuple[Any, Any]:
        return self._fn("forward")(*args)

    def backward_input(self, kept: Any, g: Any) -> tuple[Any, Any]:
        dx, pairs = self._fn("backward_input")(kept, g)
        return (_wait(dx) if self.jit else dx), pairs

    def backward_weight(self, pairs: Any) -> list[np.ndarray]:
        if self.host_w:
            k = self.cell.host_kernels
            grads = self.cell.backward_weight(k.to_host(pairs), k)
        elif self.flat:
            return split_flat(self._fn("backward_weight_flat")(pairs).asnumpy(), self.weights(), "a graph segment")
        else:
            grads = self._fn("backward_weight")(pairs)
        return [g if isinstance(g, np.ndarray) else g.asnumpy() for g in grads]

    def backward_full(self, kept: Any, g: Any) -> tuple[Any, list[np.ndarray]]:
        dx, grads = self._fn("backward_full_flat" if self.flat else "backward_full")(kept, g)
        if self.jit:
            _wait(dx)
        if self.flat:
            return dx, split_flat(grads.asnumpy(), self.weights(), "a graph segment")
        return dx, [x.asnumpy() for x in grads]


def segments_of(blocks: Sequence[ms.nn.Cell], last: bool, jit: bool, host_w: bool | None) -> list[Any]:
    """The stage's segments: runs of ordinary blocks as :class:`GraphSegment`, the others' own passes."""
    out: list[Any] = []
    run: list[ms.nn.Cell] = []
    for block in blocks:
        if own_passes(block):
            if run:
                out.append(GraphSegment(run, False, jit, host_w))
                run = []
            out.append(block.pipeline_passes())
        else:
            run.append(block)
    if run:
        out.append(GraphSegment(run, last, jit, host_w))
    elif last:
        raise ScheduleError("the last stage must end with an ordinary block (the head, which computes the loss)")
    return out


class ChainedPasses(ExplicitPasses):
    """The stage's segments chained in Python: F through them in order, B and BW in reverse."""

    name = "chained"

    def __init__(self, stage, segments: Sequence[Any]):
        self.stage, self.segments = stage, list(segments)
        self.host_w = any(getattr(s, "host_w", False) for s in self.segments)
        self.weights = [p for s in self.segments for p in s.weights()]
        have, want = {id(p) for p in self.weights}, {id(p): p for p in stage.weights}
        missing = [p.name for i, p in want.items() if i not in have]
        if missing:
            raise ScheduleError(f"stage {stage.index}: the blocks' passes give no gradient for {missing}")
        self._no_grads()

    def forward(self, saved) -> Any:
        return drain(self.forward_steps(saved))

    def forward_steps(self, saved) -> Any:
        x, kept = saved.x, []
        for i, segment in enumerate(self.segments):
            args = (x, saved.labels) if self.stage.last and i == len(self.segments) - 1 else (x,)
            x, k = yield from steps_of(segment, "forward", *args)
            kept.append(k)
        saved.values = kept
        if not self.stage.last:
            saved.x = None
        return x

    def backward_input(self, saved, grad_out) -> Any:
        return drain(self.backward_input_steps(saved, grad_out))

    def backward_input_steps(self, saved, grad_out) -> Any:
        kept, g = self._values(saved), grad_out
        pairs: list[Any] = [None] * len(self.segments)
        for i in reversed(range(len(self.segments))):
            g, pairs[i] = yield from steps_of(self.segments[i], "backward_input", kept[i], g)
        saved.pairs, saved.x, saved.labels = pairs, None, None
        return g

    def backward_weight(self, saved) -> None:
        self._add([g for segment, p in zip(self.segments, saved.pairs) for g in segment.backward_weight(p)])
        saved.pairs = None

    def backward_full(self, saved, grad_out) -> Any:
        return drain(self.backward_full_steps(saved, grad_out))

    def backward_full_steps(self, saved, grad_out) -> Any:
        kept, g = self._values(saved), grad_out
        grads: list[list[np.ndarray]] = [[] for _ in self.segments]
        for i in reversed(range(len(self.segments))):
            g, grads[i] = yield from steps_of(self.segments[i], "backward_full", kept[i], g)
        self._add([x for seg in grads for x in seg])
        return g


def steps_of(passes: Any, name: str, *args: Any) -> Generator[str, None, Any]:
    """``passes.<name>_steps(*args)`` where it exists (a pass as steps: it yields a label right
    after issuing each collective), else ``passes.<name>(*args)`` as one step that yields nothing."""
    steps = getattr(passes, f"{name}_steps", None)
    if steps is None:
        return getattr(passes, name)(*args)
    return (yield from steps(*args))


def drain(steps: Generator[str, None, Any]) -> Any:
    """Run a pass given as steps to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


__all__ = ["ChainedPasses", "GraphSegment", "drain", "own_passes", "segments_of", "steps_of"]
