"""One pipeline stage in MindSpore: forward, input gradient (B), weight gradient (W), fused backward.

A stage is an ordered list of blocks (MindSpore Cells); each maps one tensor to the next, except
the last block of the last stage, which maps (hidden, labels) to the microbatch's scalar loss.
The dx/dw split is the "generic block level" recipe (shared/reference/mindspore_cpu.md, section 3)
applied to the stage as one block, so it needs nothing from the model's code:

* F runs the stage and keeps its input;
* B runs ``ms.grad(stage, grad_position=0, sens_param=True)`` on the saved input and the output
  gradient: the input gradient only; it keeps the output gradient;
* W runs ``ms.grad(stage, grad_position=None, weights=..., sens_param=True)`` on the same two
  tensors: the weight gradients, deferred;
* BW does both in one ``ms.grad`` (1F1B, GPipe).

``ms.grad`` re-runs the stage's forward from its saved input. MindSpore's PyNative tape cannot be
kept per microbatch instead (several live ``ms.vjp`` closures of one Cell fail with "Can not find
top cell for backward"), so on this runtime T_B and T_W each include a forward and the
activations between F and B are recomputed, not stored; the measured costs go into the simulator
as they are. One call per pass, not one per block, keeps MindSpore's per-call overhead low.

Two pitfalls of the split are handled by construction:

* a weight used twice -- inside one block (``x @ w @ w``) or by two blocks of the stage (a shared
  Cell) -- gets every use: W differentiates the whole stage, and gradients are accumulated per
  Parameter object, never per hooked op (the dW-split bug of pytorch #180952 hooks ops);
* stage 0 has no input gradient to compute (its input is the data, often token ids): its B only
  keeps the output gradient and its W computes the weight gradients, as PyTorch's stage 0 runs
  its full backward in the W slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mindspore as ms
import numpy as np

from ..errors import ScheduleError

# block ids -> (stage cell, {"fwd"/"dx"/"dw"/"both": compiled function}): a stage made of the
# same blocks is compiled once per process, so a new schedule over the same cut does not
# recompile. The entry pins the blocks, as MindSpore's own compile cache pins its graphs.
_COMPILED: dict[tuple[int, ...], tuple[ms.nn.Cell, dict]] = {}


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

    def __init__(self, index: int, blocks: Sequence[ms.nn.Cell], *, first: bool, last: bool, jit: bool = False):
        if not blocks:
            raise ScheduleError(f"stage {index} has no blocks")
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
        self._saved: dict[int, _Saved] = {}
        self.grads: dict[int, np.ndarray] = {}  # id(Parameter) -> accumulated gradient

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
            else:
                fn = ms.grad(cell, grad_position=0, weights=weights, sens_param=True)
            # graph mode: one compilation per stage and function (seconds), then much faster
            self._fns[key] = ms.jit(fn) if self.jit else fn
        return self._fns[key]

    def _args(self, saved: _Saved) -> tuple:
        return (saved.x, saved.labels) if self.last else (saved.x,)

    def _accumulate(self, grads: Sequence[Any]) -> None:
        for p, g in zip(self.weights, grads):
            g = g.asnumpy()
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
        if self.first:
            return None
        return _first(self._fn("dx")(*self._args(saved), grad_out))

    def backward_weight(self, mb: int) -> None:
        """W: the weight gradients from what F and B kept, accumulated into ``grads``."""
        saved = self._saved.get(mb)
        if saved is None or saved.grad_out is None:
            raise ScheduleError(f"stage {self.index}: W of microbatch {mb} runs before its B")
        del self._saved[mb]
        if self.weights:
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
