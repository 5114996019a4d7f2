"""Compiled training passes of a tensor-parallel decoder stack, with paired recompute.

:class:`CompiledTPStack` trains the TP shards that :func:`ms_recompute.runtime.tp_model` builds
(Megatron's layer: ``h = x + g(attn(f(norm1(x))))``, ``out = h + g(mlp(f(norm2(h))))``) without
PyNative: each stretch of a layer between two collectives is one ``mindspore.jit`` graph built
from ms-models' explicit passes (forward keeps its values, backward never re-runs the forward,
weight gradients from the kept pairs), and the all-reduces between them are ms_layout.comm's
asynchronous ones, so the driver decides what computes while a collective is in flight:

* forward: the two g all-reduces of a layer, each waited for before its result is used;
* recompute (``recompute=True``: the forward keeps only each layer's input): a layer is two
  segments around one all-reduce (the second all-reduce feeds only the residual, which saves
  nothing). ``paired=True`` recomputes layers (0, 1), (2, 3), ... together in the ping-pong order of
  :func:`ms_recompute.pairing.pair_layers`, one layer's all-reduce in flight while the other computes;
  ``paired=False`` waits for each at once;
* backward: each f all-reduce (of the norm output's gradient) is in flight while the same
  sublayer's weight gradients compute (they need only local values), with ``overlap=True``.

Both orders run the same graphs on the same inputs, so their gradients are bit-identical to each
other and to the run without recompute. Every executed step is recorded (``order``: recompute steps
as :class:`ms_recompute.pairing.Step`) and timed (``events``), like the PyNative runner's.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn

from ms_models.passes import ops as P
from ms_models.passes.layer import sublayer_passes

from ..errors import RecomputeError
from ..pairing import Op, Step, check_order, pair_layers
from .checkpoint import TraceEvent


class TPLayerPasses(nn.Cell):
    """The compiled segments of one TP decoder-layer shard, cut at its collectives."""

    def __init__(self, shard_layer: nn.Cell):
        super().__init__(auto_prefix=False)
        self.norm1, self.norm2 = shard_layer.input_layernorm, shard_layer.post_attention_layernorm
        self.attn, self.mlp = sublayer_passes(shard_layer.self_attn), sublayer_passes(shard_layer.mlp)

    def weights(self) -> list:
        """The layer's parameters in the order :meth:`CompiledTPStack.backward` gives their gradients."""
        return [self.norm1.weight, self.norm2.weight, *self.attn.weights(), *self.mlp.weights()]

    def attn_forward(self, x, cos, sin, allowed):
        h1, n1, r1 = P.rms_norm(x, self.norm1.weight, self.norm1.eps)
        a, s_attn = self.attn.forward(h1, cos, sin, allowed)
        return a, (n1, r1, s_attn)

    def mlp_forward(self, x, a_sum):
        h = x + a_sum
        h2, n2, r2 = P.rms_norm(h, self.norm2.weight, self.norm2.eps)
        m, s_mlp = self.mlp.forward(h2)
        return h, m, (n2, r2, s_mlp)

    def mlp_backward(self, saved2, g):
        return self.mlp.backward_input(saved2[2], g)

    def attn_backward(self, saved1, saved2, g, dh2, cos, sin):
        n2, r2, _ = saved2
        g1 = g + P.rms_norm_dx(dh2, self.norm2.weight, n2, r2)
        dh1, w_attn = self.attn.backward_input(saved1[2], g1, cos, sin)
        return g1, dh1, w_attn

    def input_grad(self, saved1, g1, dh1):
        n1, r1, _ = saved1
        return g1 + P.rms_norm_dx(dh1, self.norm1.weight, n1, r1)

    def attn_weight_grads(self, w_attn):
        return self.attn.backward_weight(w_attn)

    def mlp_weight_grads(self, w_mlp):
        return self.mlp.backward_weight(w_mlp)

    def norm_weight_grads(self, saved1, dh1, saved2, dh2):
        return P.scale_dw(saved1[0], dh1), P.scale_dw(saved2[0], dh2)


def _compiled(cell: nn.Cell, method: str, jit: bool) -> Any:
    bound = getattr(cell, method)

    def run(*args):
        return bound(*args)

    fn = ms.jit(run) if jit else run

    def call(*args):  # tuples (kept values) as variables, or jit compiles again for each new value
        return fn(*(ms.mutable(a) if isinstance(a, tuple) else a for a in args))

    return call


class _Pending:
    """An all-reduce in flight: a numpy copy of the partial sum and its work handle."""

    def __init__(self, group: Any, tensor: ms.Tensor):
        self.buf = np.array(tensor.asnumpy(), copy=True, order="C")
        self.work = group.all_reduce(self.buf, async_op=True)

    def result(self) -> ms.Tensor:
        self.work.wait()
        return ms.Tensor.from_numpy(self.buf)


@dataclass
class Kept:
    """What one forward of a :class:`CompiledTPStack` keeps for its backward."""

    rope: tuple
    """(cos, sin, allowed) of that forward."""
    inputs: list
    """Each layer's input where it is recomputed (None once recomputed, or without recompute)."""
    values: list
    """Each layer's kept values (None until recomputed, with recompute)."""
    used: bool = False
    """Whether a backward consumed it."""


class CompiledTPStack:
    """Forward and backward of a stack of TP decoder-layer shards (``tp_model``'s ``layer.layer``
    cells) on one rank of ``group``, compiled, with recompute paired or not."""

    def __init__(
        self,
        shards: Sequence[nn.Cell],
        group: Any,
        *,
        recompute: bool = True,
        paired: bool = True,
        overlap: bool = True,
        jit: bool = True,
    ):
        if not shards:
            raise RecomputeError("CompiledTPStack needs at least one layer shard")
        self.group = group
        self.recompute, self.paired, self.overlap = recompute, paired, overlap
        self.layers = [TPLayerPasses(s) for s in shards]
        names = ("attn_forward", "mlp_forward", "mlp_backward", "attn_backward", "input_grad")
        names += ("attn_weight_grads", "mlp_weight_grads", "norm_weight_grads")
        # one compiled function per method, shared by the layers (same shapes: compiled once)
        self._fns = [{n: _compiled(cell, n, jit) for n in names} for cell in self.layers]
        self.groups = {
            layer: g for g in pair_layers(range(len(self.layers)), comms=1, overlap=paired) for layer in g.layers
        }
        self.order: list[Step] = []
        """The recompute steps of the last backward, in the order they ran."""
        self.events: list[TraceEvent] = []
        """The timed steps of the last forward and backward (``op``: compute, issue, wait, recompute)."""
        self.recompute_s = 0.0
        """Seconds spent inside recomputes during the last backward."""

    def weights(self) -> list[list[ms.Parameter]]:
        """Each layer's parameters, in the order :meth:`backward` returns their gradients."""
        return [layer.weights() for layer in self.layers]

    # ------------------------------------------------------------ forward
    def forward(self, x: ms.Tensor, cos: ms.Tensor, sin: ms.Tensor, allowed: ms.Tensor) -> tuple[ms.Tensor, Kept]:
        """The stack's output and what its backward needs: each layer's input (recompute) or its
        values. Several forwards may be kept at once (a pipeline's microbatches), each its own ``Kept``."""
        return drain(self.forward_steps(x, cos, sin, allowed))

    def forward_steps(self, x: ms.Tensor, cos: ms.Tensor, sin: ms.Tensor, allowed: ms.Tensor) -> Steps:
        """:meth:`forward` as steps: yields ``"<layer>><index>"`` right after issuing each
        all-reduce, before waiting for it, so a driver can run another pass's compute while it is
        in flight (a 1B1F pair interleaved layer by layer); returns what :meth:`forward` returns."""
        self.events = []
        kept = Kept((cos, sin, allowed), [], [])
        for i, fns in enumerate(self._fns):
            a, s1 = self._timed(i, "compute", 0, fns["attn_forward"], x, cos, sin, allowed)
            pending = self._timed(i, "issue", 0, _Pending, self.group, a)
            yield f"{i}>0"
            a_sum = self._timed(i, "wait", 0, pending.result)
            h, m, s2 = self._timed(i, "compute", 1, fns["mlp_forward"], x, a_sum)
            pending = self._timed(i, "issue", 8, _Pending, self.group, m)
            yield f"{i}>8"
            out = ms.Tensor.from_numpy(h.asnumpy() + self._timed(i, "wait", 8, pending.result).asnumpy())
            kept.inputs.append(x if self.recompute else None)
            kept.values.append(None if self.recompute else (s1, s2))
            x = out
        return x, kept

    # ------------------------------------------------------------ recompute
    def _recompute(self, kept: Kept, layer: int) -> None:
        group = self.groups[layer]
        layers = [i for i in group.layers if kept.values[i] is None]
        if set(layers) != set(group.layers):  # a partner already done: this layer alone
            group = pair_layers([layer], comms=1, overlap=False)[0]
        check_order(group, 1)
        start = time.perf_counter()
        state: dict[int, dict] = {i: {} for i in group.layers}
        cos, sin, allowed = kept.rope
        for step in group.order:
            i, st, fns = step.layer, state[step.layer], self._fns[step.layer]
            self.order.append(step)
            if step.op is Op.COMPUTE and step.index == 0:
                st["a"], st["s1"] = self._timed(i, "compute", 0, fns["attn_forward"], kept.inputs[i], cos, sin, allowed)
            elif step.op is Op.ISSUE:
                st["pending"] = self._timed(i, "issue", 0, _Pending, self.group, st["a"])
            elif step.op is Op.WAIT:
                st["a_sum"] = self._timed(i, "wait", 0, st["pending"].result)
            else:
                _, _, s2 = self._timed(i, "compute", 1, fns["mlp_forward"], kept.inputs[i], st["a_sum"])
                kept.values[i], kept.inputs[i] = (st["s1"], s2), None
        self.recompute_s += time.perf_counter() - start
        self.events.append(TraceEvent(min(group.layers), "recompute", len(group.layers), start, time.perf_counter()))

    # ------------------------------------------------------------ backward
    def backward(self, kept: Kept, g: ms.Tensor) -> tuple[ms.Tensor, list[list[np.ndarray]]]:
        """The input gradient and every layer's weight gradients (in :meth:`weights` order), from
        what :meth:`forward` kept (used up: a ``Kept`` serves one backward)."""
        return drain(self.backward_steps(kept, g))

    def backward_steps(self, kept: Kept, g: ms.Tensor) -> Steps:
        """:meth:`backward` as steps: yields ``"<layer>><index>"`` after issuing each f all-reduce
        (then the sublayer's weight gradients compute, then the wait)."""
        self._use(kept)
        cos, sin, _ = kept.rope
        grads: list[list[np.ndarray]] = [[] for _ in self.layers]
        for i in reversed(range(len(self.layers))):
            if kept.values[i] is None:
                self._recompute(kept, i)
            fns, (s1, s2) = self._fns[i], kept.values[i]
            kept.values[i] = None
            dh2_part, w_mlp = self._timed(i, "compute", 2, fns["mlp_backward"], s2, g)
            pending = self._timed(i, "issue", 1, _Pending, self.group, dh2_part)
            yield f"{i}>1"
            mlp_dw = self._weight_grads(i, 3, fns["mlp_weight_grads"], w_mlp, early=self.overlap)
            dh2 = self._timed(i, "wait", 1, pending.result)
            g1, dh1_part, w_attn = self._timed(i, "compute", 4, fns["attn_backward"], s1, s2, g, dh2, cos, sin)
            pending = self._timed(i, "issue", 2, _Pending, self.group, dh1_part)
            yield f"{i}>2"
            attn_dw = self._weight_grads(i, 5, fns["attn_weight_grads"], w_attn, early=self.overlap)
            dh1 = self._timed(i, "wait", 2, pending.result)
            g = self._timed(i, "compute", 6, fns["input_grad"], s1, g1, dh1)
            norm1, norm2 = self._timed(i, "compute", 7, fns["norm_weight_grads"], s1, dh1, s2, dh2)
            grads[i] = [t.asnumpy() for t in (norm1, norm2, *attn_dw(), *mlp_dw())]
        return g, grads

    def backward_input(self, kept: Kept, g: ms.Tensor) -> tuple[ms.Tensor, list[tuple]]:
        """B alone (a pipeline's split backward): the input gradient, and per layer what
        :meth:`backward_weight` needs; each f all-reduce is waited for at once (no weight
        gradients to hide it under). Recompute runs as in :meth:`backward`."""
        return drain(self.backward_input_steps(kept, g))

    def backward_input_steps(self, kept: Kept, g: ms.Tensor) -> Steps:
        """:meth:`backward_input` as steps: yields ``"<layer>><index>"`` after issuing each f all-reduce."""
        self._use(kept)
        cos, sin, _ = kept.rope
        pairs: list[tuple] = [()] * len(self.layers)
        for i in reversed(range(len(self.layers))):
            if kept.values[i] is None:
                self._recompute(kept, i)
            fns, (s1, s2) = self._fns[i], kept.values[i]
            kept.values[i] = None
            dh2_part, w_mlp = self._timed(i, "compute", 2, fns["mlp_backward"], s2, g)
            pending = self._timed(i, "issue", 1, _Pending, self.group, dh2_part)
            yield f"{i}>1"
            dh2 = self._timed(i, "wait", 1, pending.result)
            g1, dh1_part, w_attn = self._timed(i, "compute", 4, fns["attn_backward"], s1, s2, g, dh2, cos, sin)
            pending = self._timed(i, "issue", 2, _Pending, self.group, dh1_part)
            yield f"{i}>2"
            dh1 = self._timed(i, "wait", 2, pending.result)
            g = self._timed(i, "compute", 6, fns["input_grad"], s1, g1, dh1)
            pairs[i] = (s1, dh1, s2, dh2, w_attn, w_mlp)
        return g, pairs

    def backward_weight(self, pairs: Sequence[tuple]) -> list[list[np.ndarray]]:
        """W alone: every layer's weight gradients (in :meth:`weights` order) from what
        :meth:`backward_input` kept; no communication."""
        if len(pairs) != len(self.layers):
            raise RecomputeError(f"backward_weight needs {len(self.layers)} layers' pairs, got {len(pairs)}")
        grads = []
        for i, (s1, dh1, s2, dh2, w_attn, w_mlp) in enumerate(pairs):
            fns = self._fns[i]
            norm1, norm2 = self._timed(i, "compute", 7, fns["norm_weight_grads"], s1, dh1, s2, dh2)
            attn = self._timed(i, "compute", 5, fns["attn_weight_grads"], w_attn)
            mlp = self._timed(i, "compute", 3, fns["mlp_weight_grads"], w_mlp)
            grads.append([t.asnumpy() for t in (norm1, norm2, *attn, *mlp)])
        return grads

    def _use(self, kept: Kept) -> None:
        if not isinstance(kept, Kept) or len(kept.values) != len(self.layers):
            raise RecomputeError(f"backward needs what this stack's forward kept, got {type(kept).__name__}")
        if kept.used:
            raise RecomputeError("this forward's values were already used by a backward")
        kept.used = True
        self.order, self.recompute_s = [], 0.0

    def _weight_grads(self, layer: int, index: int, fn: Any, pairs: tuple, early: bool) -> Any:
        """Weight gradients now (in flight with the collective just issued) or when asked for."""
        if early:
            done = self._timed(layer, "compute", index, fn, pairs)
            for t in done:
                t.asnumpy()  # computed while the all-reduce is on the wire, not at the end
            return lambda: done
        return lambda: self._timed(layer, "compute", index, fn, pairs)

    def _timed(self, layer: int, op: str, index: int, fn: Any, *args: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args)
        if op == "compute":
            _sync(out)
        self.events.append(TraceEvent(layer, op, index, start, time.perf_counter()))
        return out


Steps = Generator[str, None, Any]
"""A pass as steps: yields a label after issuing each collective, returns the pass's result."""


def drain(steps: Steps) -> Any:
    """Run a pass given as steps to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _sync(out: Any) -> None:
    """Wait for a compiled call's outputs (a graph may return before its kernels finish)."""
    first = out
    while isinstance(first, tuple):
        first = first[0] if first else None
    if isinstance(first, ms.Tensor):
        first.asnumpy()


__all__ = ["CompiledTPStack", "Kept", "Steps", "TPLayerPasses", "drain"]
