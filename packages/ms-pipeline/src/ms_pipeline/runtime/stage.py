"""One pipeline stage in MindSpore: forward (F), input gradient (B), weight gradient (W), fused backward (BW).

A stage is an ordered list of blocks (MindSpore Cells); each maps one tensor to the next, except
the last block of the last stage, which maps (hidden, labels) to the microbatch's scalar loss. The
Stage keeps what each microbatch needs between its passes (first in, first out by microbatch, in
whatever order the schedule runs them) and checks that order; a strategy of :mod:`.backward`
computes (``dw=``):

* ``"explicit"``: the blocks' own explicit passes (``block.explicit_passes()``, which the blocks
  of ``ms_models.pipeline_blocks`` have): B never re-runs the forward and W is the kept pairs'
  GEMMs, under ``jit`` or in PyNative (the debug path);
* ``"stored"`` (PyNative only): linear layers' (x, g) queued by hooks in B, multiplied in W;
* ``"recompute"``: B and W each an ``ms.grad`` that re-runs the stage's forward.

A stage with blocks that bring passes of their own (``pipeline_passes()``: tensor-parallel layer
stacks, whose collectives sit between compiled segments) chains its blocks' passes in Python
instead (:mod:`.chained`; "chained"), the ordinary blocks' still compiled.

``"auto"`` takes "explicit" under ``jit`` when every block has explicit passes, else "recompute";
in PyNative (the debug path, where every module runs as a Cell, so hooks and dumps see it) it
takes "stored". Blocks whose cells carry ms-recompute's saved-tensor hooks (PyNative recompute)
keep the construct-based modes, since explicit passes never call ``construct``.
``recompute=`` (explicit passes only; True for every block, or one flag per block) keeps only a
block's input between F and B and runs its forward again right before its backward, inside B's
compiled graph: activation recompute under ``jit``.
``host_w=`` (explicit passes only) runs W's GEMMs in numpy on the kept pairs, read in place,
instead of in a compiled graph. Off by default (None or False): a compiled W that returns its
gradients as one joined tensor took 9 ms where the host's BLAS took 14 ms (two d=256 Llama
layers, one core, MindSpore 2.10); the same graph returning one output per gradient took 16-18.

Two pitfalls of the split are handled by construction: a weight used twice (inside one block,
or by two blocks of the stage) gets every use, as gradients are accumulated per Parameter object;
and stage 0, whose input is the data, computes no input gradient.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import mindspore as ms
import numpy as np

from ..errors import ScheduleError
from .backward import ExplicitPasses, _PassesCell, has_explicit_passes, hooked_for_recompute
from .chained import ChainedPasses, drain, own_passes, segments_of, steps_of
from .construct_grads import RecomputeGrads, StoredLinearGrads, _StageCell
from .deferred_dw import DeferredLinearGrads

#: how B and W get their gradients (module docstring)
DW_MODES = ("auto", "explicit", "stored", "recompute")

# block ids -> (stage cell, compiled functions, explicit passes or None): a stage made of the same
# blocks is compiled once per process, so a new schedule over the same cut does not recompile.
# The entry pins the blocks, as MindSpore's own compile cache pins its graphs.
_COMPILED: dict[tuple, tuple[ms.nn.Cell, dict, Any]] = {}


@dataclass
class _Saved:
    """What one microbatch keeps alive on a stage between its passes."""

    mb: int  # the microbatch
    x: Any  # the stage's input (F -> B/BW/W), dropped once nothing needs it
    labels: Any = None  # for the loss of the last stage
    grad_out: Any = None  # the output gradient (B -> W)
    values: Any = None  # explicit passes: what F kept for B
    pairs: Any = None  # explicit passes: what B kept for W
    done_b: bool = False  # B (or BW) ran


class Stage:
    """The blocks of one pipeline stage, with gradient accumulators for their parameters."""

    def __init__(
        self,
        index: int,
        blocks: Sequence[ms.nn.Cell],
        *,
        first: bool,
        last: bool,
        jit: bool = False,
        dw: str = "auto",
        recompute: bool | Sequence[bool] = False,
        host_w: bool | None = None,
    ):
        if not blocks:
            raise ScheduleError(f"stage {index} has no blocks")
        if dw not in DW_MODES:
            raise ScheduleError(f"stage {index}: dw={dw!r} is not one of {DW_MODES}")
        if dw == "stored" and jit:
            raise ScheduleError(f"stage {index}: dw='stored' needs PyNative (hooks do not run under jit=True)")
        self.index, self.blocks, self.first, self.last, self.jit = index, list(blocks), first, last, jit
        key = (*(id(b) for b in self.blocks), last)
        if key not in _COMPILED:
            _COMPILED[key] = (_StageCell(self.blocks, last), {}, {})
        cell, fns, explicit = _COMPILED[key]
        self.weights = list(cell.trainable_params())
        self.params: dict[int, ms.Parameter] = {id(p): p for p in self.weights}
        self.verified = False  # the stored dW's one-time check against ms.grad ran on this stage
        flags = tuple(bool(recompute) for _ in self.blocks) if isinstance(recompute, bool) else tuple(recompute)
        if len(flags) != len(self.blocks) or not all(isinstance(f, (bool, np.bool_)) for f in flags):
            raise ScheduleError(f"stage {index}: recompute={recompute!r} is not a bool or one bool per block")
        if any(own_passes(b) for b in self.blocks):
            self._chained(explicit, dw, flags, host_w)
            return
        hooked = hooked_for_recompute(self.blocks)
        use = dw == "explicit" or (dw == "auto" and jit and has_explicit_passes(self.blocks) and not hooked)
        if dw == "explicit" and not has_explicit_passes(self.blocks):
            names = [type(b).__name__ for b in self.blocks if not callable(getattr(b, "explicit_passes", None))]
            raise ScheduleError(f"stage {index}: dw='explicit' needs explicit_passes() on every block, not on {names}")
        if dw == "explicit" and hooked:
            raise ScheduleError(
                f"stage {index}: {hooked} carry saved-tensor hooks (ms-recompute in PyNative), which explicit "
                "passes would skip: take the plan off and pass recompute= instead"
            )
        if host_w not in (None, True, False):
            raise ScheduleError(f"stage {index}: host_w={host_w!r} is not True, False or None")
        if host_w and not use:
            raise ScheduleError(f"stage {index}: host_w=True needs the blocks' explicit passes (dw='explicit')")
        if any(flags) and not use:
            raise ScheduleError(f"stage {index}: recompute= needs the blocks' explicit passes (dw='explicit')")
        if use:
            if flags not in explicit:
                passes = [b.explicit_passes() for b in self.blocks]
                explicit[flags] = (_PassesCell(passes, last, flags), {})
            cell, compiled = explicit[flags]
            self.backward = ExplicitPasses(self, cell, compiled, bool(host_w))
        elif dw == "stored" or (dw == "auto" and not jit):
            self.backward = self._stored(cell, fns)
        else:
            if "deferred" in fns:  # the cells were hooked by a stored stage: hooks must not meet jit
                fns.pop("deferred").remove()
                fns.pop("checked", None)
            self.backward = RecomputeGrads(self, cell, fns)
        self.dw = self.backward.name
        self.host_w = bool(getattr(self.backward, "host_w", False))  # W's GEMMs in numpy
        self.recompute = flags
        self._saved: dict[int, _Saved] = {}

    def _chained(self, cache: dict, dw: str, flags: tuple, host_w: bool | None) -> None:
        """Blocks with passes of their own (``pipeline_passes()``, e.g. TP layer stacks): the
        stage's segments chained in Python (:mod:`.chained`), built once per blocks and mode."""
        if dw not in ("auto", "explicit"):
            raise ScheduleError(
                f"stage {self.index}: blocks with pipeline_passes() run their own passes, not dw={dw!r}"
            )
        if any(flags):
            raise ScheduleError(
                f"stage {self.index}: recompute= covers compiled blocks only; a block with pipeline_passes() "
                "recomputes by its own options"
            )
        if host_w not in (None, True, False):
            raise ScheduleError(f"stage {self.index}: host_w={host_w!r} is not True, False or None")
        key = ("chained", self.jit, host_w)
        if key not in cache:
            cache[key] = segments_of(self.blocks, self.last, self.jit, host_w)
        self.backward = ChainedPasses(self, cache[key])
        self.dw = self.backward.name
        self.host_w = self.backward.host_w
        self.recompute = flags
        self._saved: dict[int, _Saved] = {}

    def _stored(self, cell, fns):
        """Hooks on the linear cells (once per compiled stage), or recompute if none are linear."""
        if "deferred" not in fns:
            fns["deferred"] = DeferredLinearGrads(cell)
        deferred = fns["deferred"]
        if not deferred.params or (self.first and all(deferred.deferred(p) for p in self.weights)):
            return RecomputeGrads(self, cell, fns)  # nothing for B to differentiate
        return StoredLinearGrads(self, cell, fns, deferred)

    def args(self, saved: _Saved) -> tuple:
        """The forward's arguments of a microbatch."""
        return (saved.x, saved.labels) if self.last else (saved.x,)

    # ------------------------------------------------------------ the passes
    def forward(self, mb: int, x: Any, labels: Any = None) -> Any:
        """F: run the stage; keep what B needs. Returns the output (the loss on the last stage)."""
        return drain(self.forward_steps(mb, x, labels))

    def forward_steps(self, mb: int, x: Any, labels: Any = None) -> Generator[str, None, Any]:
        """:meth:`forward` as steps: a label is yielded after each collective a block's passes
        issue (only blocks with passes of their own have any), the output returned."""
        if mb in self._saved:
            raise ScheduleError(f"stage {self.index}: microbatch {mb} ran its forward twice")
        saved = self._saved[mb] = _Saved(mb, x, labels)
        return (yield from steps_of(self.backward, "forward", saved))

    def backward_input(self, mb: int, grad_out: Any) -> Any:
        """B: the input gradient; keeps what W needs. Returns dx (None on the first stage, whose
        input is the data)."""
        return drain(self.backward_input_steps(mb, grad_out))

    def backward_input_steps(self, mb: int, grad_out: Any) -> Generator[str, None, Any]:
        """:meth:`backward_input` as steps (see :meth:`forward_steps`)."""
        saved = self._pending(mb, "B")
        saved.grad_out, saved.done_b = grad_out, True
        dx = yield from steps_of(self.backward, "backward_input", saved, grad_out)
        return None if self.first else dx

    def backward_weight(self, mb: int) -> None:
        """W: the weight gradients from what F and B kept, accumulated into ``grads``."""
        saved = self._saved.get(mb)
        if saved is None or not saved.done_b:
            raise ScheduleError(f"stage {self.index}: W of microbatch {mb} runs before its B")
        del self._saved[mb]
        self.backward.backward_weight(saved)

    def backward_full(self, mb: int, grad_out: Any) -> Any:
        """BW: input and weight gradients together (1F1B, GPipe). Returns dx (None on stage 0)."""
        return drain(self.backward_full_steps(mb, grad_out))

    def backward_full_steps(self, mb: int, grad_out: Any) -> Generator[str, None, Any]:
        """:meth:`backward_full` as steps (see :meth:`forward_steps`)."""
        saved = self._pending(mb, "BW")
        del self._saved[mb]
        saved.grad_out = grad_out
        dx = yield from steps_of(self.backward, "backward_full", saved, grad_out)
        return None if self.first else dx

    def _pending(self, mb: int, what: str) -> _Saved:
        saved = self._saved.get(mb)
        if saved is None or saved.done_b:
            raise ScheduleError(f"stage {self.index}: {what} of microbatch {mb} runs before its F (or twice)")
        return saved

    # ------------------------------------------------------------ gradients and bookkeeping
    @property
    def grads(self) -> dict[int, np.ndarray]:
        """id(Parameter) -> accumulated gradient (a copy: change them with :meth:`set_grads`)."""
        return self.backward.grads()

    def set_grads(self, grads: dict[int, np.ndarray]) -> None:
        """Replace the accumulated gradients (``{}`` zeroes them)."""
        self.backward.set_grads(grads)

    def held_bytes(self) -> int:
        """Bytes of the tensors this stage holds for its in-flight microbatches (inputs, the
        values F kept, the pairs B kept); a tensor held twice counts once."""
        seen: dict[int, int] = {}

        def walk(x: Any) -> None:
            if isinstance(x, (tuple, list)):
                for y in x:
                    walk(y)
            elif hasattr(x, "nbytes") and hasattr(x, "shape"):
                seen[id(x)] = int(x.nbytes)

        for saved in self._saved.values():
            walk((saved.x, saved.labels, saved.values, saved.pairs))
        return sum(seen.values())

    @property
    def in_flight(self) -> int:
        """Microbatches whose values (for B or W) this stage still holds."""
        return len(self._saved)

    def zero_grads(self) -> None:
        self.backward.set_grads({})
