"""The strategies built on ``ms.grad`` of the stage's ``construct`` (see :mod:`.backward`):
:class:`RecomputeGrads` (any block, under ``jit`` or not) and :class:`StoredLinearGrads` (PyNative,
hooks on the linear layers). Their gradients accumulate in numpy per Parameter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mindspore as ms
import numpy as np

from ..errors import ScheduleError
from .backward import _call
from .deferred_dw import DeferredLinearGrads


def _first(grad: Any) -> Any:
    """ms.grad returns a bare tensor for one input, a tuple for several."""
    return grad[0] if isinstance(grad, tuple) else grad


class _StageCell(ms.nn.Cell):
    """The blocks of a stage as one Cell (what ms.grad and ms.jit differentiate and compile)."""

    def __init__(self, blocks: Sequence[ms.nn.Cell], last: bool):
        super().__init__()
        names = {id(p): p.name for b in blocks for p in b.get_parameters()}
        self.blocks = ms.nn.CellList(list(blocks))
        self.n = len(blocks)
        self.last = last
        for p in self.get_parameters():  # a CellList renames what it holds: keep the model's names
            p.name = names[id(p)]

    def construct(self, x, labels=None):
        for i in range(self.n - 1):
            x = self.blocks[i](x)
        if self.last:
            return self.blocks[self.n - 1](x, labels)
        return self.blocks[self.n - 1](x)


class _NumpyGrads:
    """Accumulators in numpy, per Parameter (the ms.grad-based strategies)."""

    def __init__(self):
        self.acc: dict[int, np.ndarray] = {}

    def add(self, params: Sequence[ms.Parameter], grads: Sequence[Any]) -> None:
        for p, g in zip(params, grads):
            g = g if isinstance(g, np.ndarray) else g.asnumpy()
            have = self.acc.get(id(p))
            self.acc[id(p)] = g.copy() if have is None else have + g

    def grads(self) -> dict[int, np.ndarray]:
        return dict(self.acc)

    def set_grads(self, grads: dict[int, np.ndarray]) -> None:
        self.acc = {k: v.copy() for k, v in grads.items()}


class RecomputeGrads(_NumpyGrads):
    """B and W each an ``ms.grad`` of the whole stage from its saved input (forward re-run)."""

    name = "recompute"

    def __init__(self, stage, cell: _StageCell, fns: dict):
        super().__init__()
        self.stage, self.cell, self._fns = stage, cell, fns

    def _fn(self, what: str) -> Any:
        key = (what, self.stage.jit)
        if key not in self._fns:
            cell, weights = self.cell, self.stage.weights
            if what == "fwd":
                fn = _call(cell)
            elif what == "dx":
                fn = ms.grad(cell, grad_position=0, sens_param=True)
            elif what == "dw":
                fn = ms.grad(cell, grad_position=None, weights=weights, sens_param=True)
            else:
                fn = ms.grad(cell, grad_position=0, weights=weights, sens_param=True)
            self._fns[key] = ms.jit(fn) if self.stage.jit else fn
        return self._fns[key]

    def forward(self, saved) -> Any:
        return self._fn("fwd")(*self.stage.args(saved))

    def backward_input(self, saved, grad_out) -> Any:
        if self.stage.first:
            return None  # stage 0 differentiates nothing but its weights: all of it in W
        return _first(self._fn("dx")(*self.stage.args(saved), grad_out))

    def backward_weight(self, saved) -> None:
        if self.stage.weights:
            self.add(self.stage.weights, self._fn("dw")(*self.stage.args(saved), saved.grad_out))

    def backward_full(self, saved, grad_out) -> Any:
        args = (*self.stage.args(saved), grad_out)
        if not self.stage.weights:
            return None if self.stage.first else _first(self._fn("dx")(*args))
        if self.stage.first:
            self.add(self.stage.weights, self._fn("dw")(*args))
            return None
        dx, dw = self._fn("both")(*args)
        self.add(self.stage.weights, dw)
        return _first(dx)


class StoredLinearGrads(_NumpyGrads):
    """PyNative: hooks queue the linear layers' (x, g) in B; W multiplies them (``dW = g^T x``)."""

    name = "stored"

    def __init__(self, stage, cell: _StageCell, fns: dict, deferred: DeferredLinearGrads):
        super().__init__()
        self.stage, self.cell, self._fns, self.deferred = stage, cell, fns, deferred
        #: weights B differentiates (norms, embeddings, expert stacks, routers, shared weights)
        self.early = [p for p in stage.weights if not deferred.deferred(p)]
        self.fallback = RecomputeGrads(stage, cell, fns)  # the forward and the fused BW
        self.fallback.acc = self.acc

    def _early_fn(self) -> Any:
        if "early" not in self._fns:
            position = None if self.stage.first else 0
            self._fns["early"] = ms.grad(self.cell, grad_position=position, weights=self.early or None, sens_param=True)
        return self._fns["early"]

    def forward(self, saved) -> Any:
        return self.fallback.forward(saved)

    def backward_input(self, saved, grad_out) -> Any:
        with self.deferred.recording(saved.mb):
            out = self._early_fn()(*self.stage.args(saved), grad_out)
        dx, early = (None, out) if self.stage.first else out if self.early else (out, ())
        if self.early:
            self.add(self.early, early)
        if self.checked:
            saved.x = saved.labels = None  # W needs only the queued pairs
        return None if self.stage.first else _first(dx)

    def backward_weight(self, saved) -> None:
        grads = self.deferred.pop_grads(saved.mb)
        if not self.checked:
            self._check(saved, grads)
        self.add(self.deferred.params, [grads[id(p)] for p in self.deferred.params])

    def backward_full(self, saved, grad_out) -> Any:
        return self.fallback.backward_full(saved, grad_out)

    def set_grads(self, grads: dict[int, np.ndarray]) -> None:
        super().set_grads(grads)
        self.fallback.acc = self.acc

    @property
    def checked(self) -> bool:
        return self._fns.get("checked", False)

    def _check(self, saved, grads: dict[int, np.ndarray]) -> None:
        """Once per stage: the deferred gradients of one microbatch against a full ``ms.grad``. A
        weight used outside its cell's ``construct`` (``ops.matmul(x, lin.weight)``) escapes the
        hooks; this says which instead of training with a wrong gradient."""
        params = self.deferred.params
        fn = ms.grad(self.cell, grad_position=None, weights=params, sens_param=True)
        for p, want in zip(params, fn(*self.stage.args(saved), saved.grad_out)):
            want, got = want.asnumpy(), grads[id(p)]
            if not np.allclose(got, want, rtol=1e-3, atol=1e-5 * max(1.0, float(np.abs(want).max()))):
                raise ScheduleError(
                    f"stage {self.stage.index}: the deferred gradient of {p.name!r} differs from ms.grad's "
                    f"(max error {float(np.abs(got - want).max()):.3g}); the weight is used outside its "
                    "cell's construct: build the stage with dw='recompute'"
                )
        self._fns["checked"] = self.stage.verified = True
