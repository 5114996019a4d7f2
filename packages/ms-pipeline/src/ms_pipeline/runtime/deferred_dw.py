"""Deferred weight gradients of linear layers: the W pass without a second forward.

ZeroBubble splits a layer's backward into dx (needed by the previous stage now) and dW (needed
only by the optimizer, so it can fill a bubble). For ``y = x W^T + b`` the dW half is two
reductions over what the dx half already has at hand: ``dW = g^T x`` and ``db = sum(g)``, with
``x`` the layer's input and ``g`` its output gradient. Megatron's ``WeightGradStore`` queues the
pair and runs the GEMM later; this module does the same for MindSpore with public Cell hooks
(docs/mindspore-cpu.md §5, recipe 2, verified there and in the tests):

* a forward hook pushes each linear cell's input on a stack of that cell (PyNative only);
* a backward hook pops the newest input of the cell (backward runs in reverse order, and a
  recomputed layer pushes its input again just before its backward) and queues ``(x, g)``;
* W turns the queue into gradients of the deferred weights.

Hooks record only inside :meth:`DeferredLinearGrads.recording`, i.e. during a stage's B pass.
A cell counts as linear when its only own parameters are a 2-D ``weight`` and an optional 1-D
``bias`` and it maps a probe input to ``x @ weight.T (+ bias)``; a weight that some other cell
also holds (tied embeddings) stays with the B pass. A use of the weight outside its cell's
``construct`` is invisible to the hooks: :class:`~ms_pipeline.runtime.Stage` checks the deferred
gradients once against a full ``ms.grad`` and says which weight misbehaves.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import ops


def _own_params(cell: ms.nn.Cell) -> dict[str, ms.Parameter]:
    return {name: p for name, p in cell.parameters_and_names(expand=False) if p.requires_grad}


def is_linear(cell: ms.nn.Cell) -> bool:
    """Whether ``cell`` computes ``x @ weight.T (+ bias)`` with nothing else trainable in it."""
    own = _own_params(cell)
    weight, bias = own.get("weight"), own.get("bias")
    if weight is None or set(own) - {"weight", "bias"} or weight.ndim != 2 or any(True for _ in cell.cells()):
        return False
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        return False
    probe = np.random.default_rng(0).standard_normal((3, weight.shape[1])).astype(np.float32)
    try:
        got = cell(ms.Tensor(probe, weight.dtype)).asnumpy()
    except Exception:  # a cell that cannot take a 2-D input is not a plain linear
        return False
    want = probe @ weight.asnumpy().T + (0.0 if bias is None else bias.asnumpy())
    return got.shape == want.shape and bool(np.allclose(got, want, rtol=1e-4, atol=1e-5))


class DeferredLinearGrads:
    """Hooks on the linear cells of a stage that queue ``(x, g)`` per microbatch for the W pass."""

    def __init__(self, root: ms.nn.Cell):
        cells = [c for _, c in root.cells_and_names() if c is not root]
        owners: dict[int, set[int]] = defaultdict(set)
        for c in [root, *cells]:
            for p in _own_params(c).values():
                owners[id(p)].add(id(c))
        linear = [c for c in {id(c): c for c in cells}.values() if is_linear(c)]
        #: the linear cells whose weights (and biases) only they hold: their gradients are deferred
        self.cells = [c for c in linear if all(owners[id(p)] == {id(c)} for p in _own_params(c).values())]
        self.params = [p for c in self.cells for p in _own_params(c).values()]
        self._ids = {id(p) for p in self.params}
        self._inputs: dict[int, list[Any]] = defaultdict(list)
        self._queues: dict[int, list[tuple[ms.nn.Cell, Any, Any]]] = {}
        self._mb: int | None = None
        self._handles = [c.register_forward_hook(self._fwd) for c in self.cells]
        self._handles += [c.register_backward_hook(self._bwd) for c in self.cells]

    def remove(self) -> None:
        """Take the hooks off the cells (hooks must not be there when the cells are jit-compiled)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def deferred(self, p: ms.Parameter) -> bool:
        return id(p) in self._ids

    def _fwd(self, cell: ms.nn.Cell, inputs: Sequence[Any], output: Any) -> None:
        if self._mb is not None:
            self._inputs[id(cell)].append(inputs[0])

    def _bwd(self, cell: ms.nn.Cell, grad_input: Any, grad_output: Sequence[Any]) -> None:
        if self._mb is not None:
            self._queues[self._mb].append((cell, self._inputs[id(cell)].pop(), grad_output[0]))

    @contextmanager
    def recording(self, mb: int) -> Iterator[None]:
        """Queue ``(x, g)`` of every linear call of microbatch ``mb`` (the B pass runs inside)."""
        self._mb, self._queues[mb] = mb, []
        try:
            yield
        finally:
            self._mb = None
            self._inputs.clear()  # inputs pushed by a forward whose backward never came (recompute)

    def pending(self, mb: int) -> int:
        """Queued ``(x, g)`` pairs of a microbatch (0 once W took them)."""
        return len(self._queues.get(mb, ()))

    def pop_grads(self, mb: int) -> dict[int, np.ndarray]:
        """W: id(Parameter) -> this microbatch's gradient of every deferred weight and bias."""
        out: dict[int, np.ndarray] = {}
        for cell, x, g in self._queues.pop(mb, []):
            x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
            parts = [(cell.weight, ops.matmul(g2.T, x2))]
            if getattr(cell, "bias", None) is not None and self.deferred(cell.bias):
                parts.append((cell.bias, g2.sum(axis=0)))
            for p, grad in parts:
                grad = grad.asnumpy()
                out[id(p)] = grad if id(p) not in out else out[id(p)] + grad
        for p in self.params:  # a cell the microbatch never reached still has a (zero) gradient
            if id(p) not in out:
                out[id(p)] = np.zeros_like(p.asnumpy())
        return out
