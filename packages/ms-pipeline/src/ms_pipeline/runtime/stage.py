"""One pipeline stage in MindSpore: forward, input gradient (B), weight gradient (W), fused backward.

A stage is an ordered list of blocks (MindSpore Cells); each maps one tensor to the next, except
the last block of the last stage, which maps (hidden, labels) to the microbatch's scalar loss.
Two ways to split the backward into dx and dW (``dw=``):

* ``"stored"`` (default in PyNative), the ZeroBubble way: B runs one ``ms.grad`` for the input
  gradient and the gradients of the weights that are not plain linear layers (norms, embeddings,
  expert stacks, routers), while hooks queue each linear layer's input and output gradient
  (:mod:`.deferred_dw`); W is then just ``dW = g^T x`` and ``db = sum(g)`` per queued pair. The
  first time a stage runs W it checks the deferred gradients against a full ``ms.grad`` once.
* ``"recompute"`` (the only choice under ``jit``: hooks do not run in graph mode), the "generic
  block level" recipe (docs/mindspore-cpu.md §5, recipe 3) applied to the stage as one
  block: B is ``ms.grad(stage, grad_position=0, sens_param=True)`` and W is
  ``ms.grad(stage, grad_position=None, weights=..., sens_param=True)`` on the saved input and
  output gradient, so W costs a forward and a backward of its own.

BW does both in one ``ms.grad`` (1F1B, GPipe). Every ``ms.grad`` re-runs the stage's forward from
its saved input: MindSpore's PyNative tape cannot be kept per microbatch (several live ``ms.vjp``
closures of one Cell fail with "Can not find top cell for backward"), so the activations between F
and B are recomputed, not stored; the measured costs go into the simulator as they are. One call
per pass, not one per block, keeps MindSpore's per-call overhead low.

Two pitfalls of the split are handled by construction:

* a weight used twice -- inside one block (``x @ w @ w``) or by two blocks of the stage (a shared
  Cell) -- gets every use: each call of a linear cell queues its own pair, a weight some other
  cell also holds is never deferred, and gradients are accumulated per Parameter object, never
  per hooked op (the dW-split bug of pytorch #180952 hooks ops);
* stage 0 has no input gradient to compute (its input is the data, often token ids): in
  ``"recompute"`` its B only keeps the output gradient and its W computes the weight gradients,
  as PyTorch's stage 0 runs its full backward in the W slot; in ``"stored"`` its B differentiates
  the non-linear weights only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mindspore as ms
import numpy as np

from ..errors import ScheduleError
from .deferred_dw import DeferredLinearGrads

# block ids -> (stage cell, {"fwd"/"dx"/"dw"/"both": compiled function}): a stage made of the
# same blocks is compiled once per process, so a new schedule over the same cut does not
# recompile. The entry pins the blocks, as MindSpore's own compile cache pins its graphs.
_COMPILED: dict[tuple[int, ...], tuple[ms.nn.Cell, dict]] = {}

#: how W gets the weight gradients: "stored" (queued linear-layer pairs, PyNative), "recompute"
#: (a second ms.grad), "auto" (stored unless jit)
DW_MODES = ("auto", "stored", "recompute")


class _StageCell(ms.nn.Cell):
    """The blocks of a stage as one Cell (what ms.grad and ms.jit differentiate and compile)."""

    def __init__(self, blocks: Sequence[ms.nn.Cell], last: bool):
        super().__init__()
        names = {id(p): p.name for b in blocks for p in b.trainable_params()}
        self.blocks = ms.nn.CellList(list(blocks))
        self.n = len(blocks)
        self.last = last
        for p in self.trainable_params():  # a CellList renames what it holds: keep the model's names
            p.name = names[id(p)]

    def construct(self, x, labels=None):
        for i in range(self.n - 1):
            x = self.blocks[i](x)
        if self.last:
            return self.blocks[self.n - 1](x, labels)
        return self.blocks[self.n - 1](x)


def _call(cell: ms.nn.Cell) -> Any:
    """A plain function calling the cell (``ms.jit`` takes functions, not lambdas)."""

    def forward(*args):
        return cell(*args)

    return forward


def _first(grad: Any) -> Any:
    """ms.grad returns a bare tensor for one input, a tuple for several."""
    return grad[0] if isinstance(grad, tuple) else grad


@dataclass
class _Saved:
    """What one microbatch keeps alive on a stage between its passes."""

    x: Any  # the stage's input (F -> B/BW/W)
    labels: Any = None  # for the loss of the last stage
    grad_out: Any = None  # the output gradient (B -> W)


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
    ):
        if not blocks:
            raise ScheduleError(f"stage {index} has no blocks")
        if dw not in DW_MODES:
            raise ScheduleError(f"stage {index}: dw={dw!r} is not one of {DW_MODES}")
        if dw == "stored" and jit:
            raise ScheduleError(f"stage {index}: dw='stored' needs PyNative (hooks do not run under jit=True)")
        self.index = index
        self.blocks = list(blocks)
        self.first = first
        self.last = last
        self.jit = jit
        key = (*(id(b) for b in self.blocks), last)
        if key not in _COMPILED:
            _COMPILED[key] = (_StageCell(self.blocks, last), {})
        self.cell, self._fns = _COMPILED[key]
        self.weights = list(self.cell.trainable_params())
        self.params: dict[int, ms.Parameter] = {id(p): p for p in self.weights}
        self.dw = "recompute" if jit or dw == "recompute" else "stored"
        self.deferred: DeferredLinearGrads | None = None  # hooked at the first B (BW never needs them)
        self.early: list[ms.Parameter] = self.weights  # weights whose gradients B computes
        if self.dw == "recompute" and "deferred" in self._fns:  # the cells were hooked by a stored stage
            self._fns.pop("deferred").remove()
            self._fns.pop("checked", None)
        self._saved: dict[int, _Saved] = {}
        self.grads: dict[int, np.ndarray] = {}  # id(Parameter) -> accumulated gradient
        self.verified = False  # this stage ran the one-time check of the stored dW (one more ms.grad)

    # ------------------------------------------------------------ autograd helpers
    def _fn(self, what: str) -> Any:
        """The stage's "fwd", or its ``ms.grad``: "dx" (input only), "dw" (weights only), "both"."""
        key = (what, self.jit)
        if key not in self._fns:
            cell, weights = self.cell, self.weights
            if what == "fwd":
                fn = _call(cell)
            elif what == "dx":
                fn = ms.grad(cell, grad_position=0, sens_param=True)
            elif what == "dw":
                fn = ms.grad(cell, grad_position=None, weights=weights, sens_param=True)
            elif what == "early":  # stored dW: the weights B keeps, with (or, on stage 0, without) dx
                position = None if self.first else 0
                early = self.early or None  # no weights left for B: the input gradient alone
                fn = ms.grad(cell, grad_position=position, weights=early, sens_param=True)
            else:
                fn = ms.grad(cell, grad_position=0, weights=weights, sens_param=True)
            # graph mode: one compilation per stage and function (seconds), then much faster
            self._fns[key] = ms.jit(fn) if self.jit else fn
        return self._fns[key]

    def _args(self, saved: _Saved) -> tuple:
        return (saved.x, saved.labels) if self.last else (saved.x,)

    def _accumulate(self, grads: Sequence[Any], params: Sequence[ms.Parameter] | None = None) -> None:
        for p, g in zip(self.weights if params is None else params, grads):
            g = g if isinstance(g, np.ndarray) else g.asnumpy()
            acc = self.grads.get(id(p))
            self.grads[id(p)] = g.copy() if acc is None else acc + g

    # ------------------------------------------------------------ the passes
    def forward(self, mb: int, x: Any, labels: Any = None) -> Any:
        """F: run the stage; keep its input. Returns the output (the loss on the last stage)."""
        if mb in self._saved:
            raise ScheduleError(f"stage {self.index}: microbatch {mb} ran its forward twice")
        saved = self._saved[mb] = _Saved(x, labels)
        return self._fn("fwd")(*self._args(saved))

    def backward_input(self, mb: int, grad_out: Any) -> Any:
        """B: the input gradient only; keeps the output gradient for W. Returns dx (None on the
        first stage, whose input is the data)."""
        saved = self._pending(mb, "B")
        saved.grad_out = grad_out
        if self.dw == "stored" and (self.deferred is None or self.deferred is not self._fns.get("deferred")):
            self._hook()  # first B, or a jit stage over the same cells took the hooks off since
        if self.deferred is not None:
            with self.deferred.recording(mb):
                out = self._fn("early")(*self._args(saved), grad_out)
            dx, early = (None, out) if self.first else out if self.early else (out, ())
            if self.early:
                self._accumulate(early, self.early)
            if self._checked:
                saved.x = saved.labels = None  # W needs only the queued pairs
            return None if self.first else _first(dx)
        if self.first:
            return None
        return _first(self._fn("dx")(*self._args(saved), grad_out))

    def backward_weight(self, mb: int) -> None:
        """W: the weight gradients from what F and B kept, accumulated into ``grads``."""
        saved = self._saved.get(mb)
        if saved is None or saved.grad_out is None:
            raise ScheduleError(f"stage {self.index}: W of microbatch {mb} runs before its B")
        del self._saved[mb]
        if self.deferred is not None:
            grads = self.deferred.pop_grads(mb)
            if not self._checked:
                self._check(saved, grads)
            self._accumulate([grads[id(p)] for p in self.deferred.params], self.deferred.params)
        elif self.weights:
            self._accumulate(self._fn("dw")(*self._args(saved), saved.grad_out))

    def backward_full(self, mb: int, grad_out: Any) -> Any:
        """BW: input and weight gradients together (1F1B, GPipe). Returns dx (None on stage 0)."""
        saved = self._pending(mb, "BW")
        del self._saved[mb]
        args = (*self._args(saved), grad_out)
        if not self.weights:
            return None if self.first else _first(self._fn("dx")(*args))
        if self.first:
            self._accumulate(self._fn("dw")(*args))
            return None
        dx, dw = self._fn("both")(*args)
        self._accumulate(dw)
        return _first(dx)

    def _hook(self) -> None:
        """Put the deferred-dW hooks on the linear cells (once per compiled stage) and sort the
        weights into those B differentiates and those W gets from the queued pairs."""
        if "deferred" not in self._fns:
            self._fns["deferred"] = DeferredLinearGrads(self.cell)
        deferred = self._fns["deferred"]
        early = [p for p in self.weights if not deferred.deferred(p)]
        if (self.first and not early) or not deferred.params:  # nothing to differentiate in B
            self.dw = "recompute"
        else:
            self.deferred, self.early = deferred, early

    @property
    def _checked(self) -> bool:
        return self._fns.get("checked", False)

    def _check(self, saved: _Saved, grads: dict[int, np.ndarray]) -> None:
        """Once per stage: the deferred gradients of one microbatch against a full ``ms.grad``. A
        weight used outside its cell's ``construct`` (``ops.matmul(x, lin.weight)``) escapes the
        hooks; this says which instead of training with a wrong gradient."""
        params = self.deferred.params
        fn = ms.grad(self.cell, grad_position=None, weights=params, sens_param=True)
        for p, want in zip(params, fn(*self._args(saved), saved.grad_out)):
            want, got = want.asnumpy(), grads[id(p)]
            if not np.allclose(got, want, rtol=1e-3, atol=1e-5 * max(1.0, float(np.abs(want).max()))):
                raise ScheduleError(
                    f"stage {self.index}: the deferred gradient of {p.name!r} differs from ms.grad's "
                    f"(max error {float(np.abs(got - want).max()):.3g}); the weight is used outside its "
                    "cell's construct: build the stage with dw='recompute'"
                )
        self._fns["checked"] = self.verified = True

    def _pending(self, mb: int, what: str) -> _Saved:
        saved = self._saved.get(mb)
        if saved is None or saved.grad_out is not None:
            raise ScheduleError(f"stage {self.index}: {what} of microbatch {mb} runs before its F (or twice)")
        return saved

    # ------------------------------------------------------------ bookkeeping
    @property
    def in_flight(self) -> int:
        """Microbatches whose input (or W inputs) this stage still holds."""
        return len(self._saved)

    def zero_grads(self) -> None:
        self.grads = {}
