"""One pipeline stage in MindSpore: forward, input gradient (B), weight gradient (W), fused backward.

A stage is an ordered list of blocks (MindSpore Cells); each maps one tensor to the next, except
the last block of the last stage, which maps (hidden, labels) to the microbatch's scalar loss.
The dx/dw split is the "generic block level" recipe (shared/reference/mindspore_cpu.md, section 3),
which needs nothing from the model's code:

* F runs the blocks and keeps each block's input;
* B walks the blocks backwards with ``ms.grad(block, grad_position=0, sens_param=True)``: the
  input gradient only. It keeps, per block, the input and the gradient of the output;
* W runs ``ms.grad(block, grad_position=None, weights=..., sens_param=True)`` on what B kept:
  the weight gradients, deferred;
* BW does both in one ``ms.grad`` per block (1F1B, GPipe).

``ms.grad`` recomputes a block's forward from its saved input (MindSpore's PyNative tape cannot be
kept per microbatch: several live ``ms.vjp`` closures of one Cell fail with "Can not find top cell
for backward"), so on this runtime T_B and T_W each include one block forward; the measured costs
go into the simulator as they are.

Two pitfalls of the split are handled by construction:

* a weight used twice -- inside one block (``x @ w @ w``) or by two blocks of the stage (a shared
  Cell) -- gets every use: W differentiates whole blocks, and gradients are accumulated per
  Parameter object, never per hooked op (the dW-split bug of pytorch #180952 hooks ops);
* the first block of stage 0 has no input gradient to compute (its input is the data, often
  token ids): B stops one block early and W covers that block from its saved input, as PyTorch's
  stage 0 does its full backward in the W slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mindspore as ms
import numpy as np

from ..errors import ScheduleError


def _call(block: ms.nn.Cell) -> Any:
    """A plain function calling the block (``ms.jit`` takes functions, not lambdas)."""

    def forward(*args):
        return block(*args)

    return forward


def _first(grad: Any) -> Any:
    """ms.grad returns a bare tensor for one input, a tuple for several."""
    return grad[0] if isinstance(grad, tuple) else grad


@dataclass
class _Saved:
    """What one microbatch keeps alive on a stage between its passes."""

    inputs: list = field(default_factory=list)  # input of each block (F -> B/BW)
    labels: Any = None  # for the loss block of the last stage
    pending_w: list = field(default_factory=list)  # (block index, input, output grad) (B -> W)


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
        self._weights = [list(b.trainable_params()) for b in self.blocks]
        self._saved: dict[int, _Saved] = {}
        self._grad_fns: dict[tuple[int, str], Any] = {}
        self.grads: dict[int, np.ndarray] = {}  # id(Parameter) -> accumulated gradient
        self.params: dict[int, ms.Parameter] = {id(p): p for ws in self._weights for p in ws}

    # ------------------------------------------------------------ autograd helpers
    def _grad_fn(self, j: int, what: str) -> Any:
        """Cached function of block j: "fwd", or its ``ms.grad``: "dx" (input only), "dw"
        (weights only) or "both"."""
        key = (j, what)
        if key not in self._grad_fns:
            block, weights = self.blocks[j], self._weights[j]
            if what == "fwd":
                fn = _call(block)
            elif what == "dx":
                fn = ms.grad(block, grad_position=0, sens_param=True)
            elif what == "dw":
                fn = ms.grad(block, grad_position=None, weights=weights, sens_param=True)
            else:
                fn = ms.grad(block, grad_position=0, weights=weights, sens_param=True)
            # graph mode per block: one compilation each (seconds), then several times faster
            self._grad_fns[key] = ms.jit(fn) if self.jit else fn
        return self._grad_fns[key]

    def _args(self, j: int, saved: _Saved, x: Any) -> tuple:
        """Block j's inputs: the hidden state, and the labels for the loss block."""
        return (x, saved.labels) if self.last and j == len(self.blocks) - 1 else (x,)

    def _accumulate(self, j: int, grads: Sequence[Any]) -> None:
        for p, g in zip(self._weights[j], grads):
            g = g.asnumpy()
            acc = self.grads.get(id(p))
            self.grads[id(p)] = g.copy() if acc is None else acc + g

    def _needs_dx(self, j: int) -> bool:
        return not (self.first and j == 0)

    # ------------------------------------------------------------ the passes
    def forward(self, mb: int, x: Any, labels: Any = None) -> Any:
        """F: run the blocks; keep each block's input. Returns the output (the loss on the last stage)."""
        if mb in self._saved:
            raise ScheduleError(f"stage {self.index}: microbatch {mb} ran its forward twice")
        saved = self._saved[mb] = _Saved(labels=labels)
        for j in range(len(self.blocks)):
            saved.inputs.append(x)
            x = self._grad_fn(j, "fwd")(*self._args(j, saved, x))
        return x

    def backward_input(self, mb: int, grad_out: Any) -> Any:
        """B: the input gradient only; keeps (input, output grad) per block for W. Returns dx
        (None on the first stage, whose input is the data)."""
        saved = self._pop_forward(mb, "B")
        g = grad_out
        for j in range(len(self.blocks) - 1, -1, -1):
            x = saved.inputs[j]
            if self._weights[j]:
                saved.pending_w.append((j, x, g))
            g = _first(self._grad_fn(j, "dx")(*self._args(j, saved, x), g)) if self._needs_dx(j) else None
        saved.inputs = []  # what only dx needed is gone; W keeps block inputs and output grads
        self._saved[mb] = saved
        return g

    def backward_weight(self, mb: int) -> None:
        """W: the weight gradients from what B kept, accumulated into ``grads``."""
        saved = self._saved.get(mb)
        if saved is None or saved.inputs:
            raise ScheduleError(f"stage {self.index}: W of microbatch {mb} runs before its B")
        del self._saved[mb]
        for j, x, g in saved.pending_w:
            self._accumulate(j, self._grad_fn(j, "dw")(*self._args(j, saved, x), g))

    def backward_full(self, mb: int, grad_out: Any) -> Any:
        """BW: input and weight gradients together (1F1B, GPipe). Returns dx (None on stage 0)."""
        saved = self._pop_forward(mb, "BW")
        self._saved.pop(mb)
        g = grad_out
        for j in range(len(self.blocks) - 1, -1, -1):
            args = self._args(j, saved, saved.inputs[j])
            if not self._weights[j]:
                g = _first(self._grad_fn(j, "dx")(*args, g)) if self._needs_dx(j) else None
            elif self._needs_dx(j):
                dx, dw = self._grad_fn(j, "both")(*args, g)
                self._accumulate(j, dw)
                g = _first(dx)
            else:
                self._accumulate(j, self._grad_fn(j, "dw")(*args, g))
                g = None
        return g

    def _pop_forward(self, mb: int, what: str) -> _Saved:
        saved = self._saved.get(mb)
        if saved is None or not saved.inputs:
            raise ScheduleError(f"stage {self.index}: {what} of microbatch {mb} runs before its F")
        return saved

    # ------------------------------------------------------------ bookkeeping
    @property
    def in_flight(self) -> int:
        """Microbatches whose activations (or W inputs) this stage still holds."""
        return len(self._saved)

    def zero_grads(self) -> None:
        self.grads = {}
