"""A MindSpore Cell's backward item from tensor hooks, instead of a Cell backward hook.

`Cell.register_backward_hook` wraps a Cell's inputs and outputs in a `CellBackwardHook` op; on the
benchmark model (docs/ms-probe.md) these hooks alone cost 1.09-1.16x of a PyNative training step,
the largest part of a statistics dump. The two gradients of a backward item come as exactly, for
less (same model, empty hooks: 0.97x, within the noise), from tensor hooks:
- grad_output: the gradient of each output tensor (dL/dy summed over every consumer of y, as the
  CellBackwardHook's own);
- grad_input: the gradient of an identity copy of each positional floating-point input, made as the
  Cell is entered, so that only this Cell consumes it: this Cell's share of dL/dx alone.

When items are handed to the recorder (their order in dump.json, and the parameter-gradient item of
a Cell following its backward item, are those of the Cell backward hooks):
- a call with inputs to differentiate: when its last input gradient arrives (its outputs' come
  first; an output that is one of its copied inputs is copied again, so that its hook fires first);
- a call without (an embedding's integer ids): its end is not seen, so once its outputs' gradients
  are in it waits until a call entered before it ends, or the pipeline pass ends (`end_pass`), or
  the step (`flush`);
- inputs whose gradient never comes (unused by the loss) leave their call open until the pass or
  the step ends, which hands it over with None there (as a torch full backward hook gives None).
Each call keeps its own gradients: a Cell called twice in a step (a shared layer) gets two items.
"""

from __future__ import annotations

from typing import Any, Callable

Emit = Callable[[str, str, "tuple | None", tuple, Any], None]
"""recorder.backward(path, cls, grad_input, grad_output, parent); grad_input None: no input to differentiate."""


class _Call:
    """One call of a Cell whose gradients are arriving."""

    __slots__ = ("cls", "grad_in", "grad_out", "hooked", "inputs_waiting", "outputs_waiting", "parent", "path", "seq")

    def __init__(self, seq: int, path: str, cls: str, parent: Any):
        self.seq, self.path, self.cls, self.parent = seq, path, cls, parent
        self.grad_in: list[Any] = []  # one slot per positional tensor input
        self.grad_out: list[Any] = []  # one slot per output tensor
        self.inputs_waiting = 0  # input gradients still to come
        self.outputs_waiting = 0  # output gradients still to come
        self.hooked = 0  # inputs copied and hooked


class GradTaps:
    """Copies a Cell's tensor inputs and hooks them and its outputs; emits one item per call."""

    def __init__(self, emit: Emit):
        import mindspore as ms
        from mindspore.ops.auto_generate.gen_ops_prim import identity_op

        self._emit = emit
        self._tensor = ms.Tensor
        self._floats = frozenset((ms.float16, ms.float32, ms.float64, ms.bfloat16))
        # An Identity op: a new tensor with an autograd node of its own (a primitive, not one of the
        # functional APIs level L1 wraps). A view (x.view(x.shape)) is cheaper to make but made
        # the step slower: 1.087x against 0.995x for empty hooks on the benchmark model.
        self._copy = identity_op
        self._seq = 0
        self._entered: dict[str, list[_Call]] = {}  # path -> calls entered, not yet returned
        self._open: dict[int, _Call] = {}  # seq -> calls not yet emitted (in call order)
        self._ready: dict[int, _Call] = {}  # seq -> calls without inputs to differentiate, outputs' gradients in

    def _differentiable(self, x: Any) -> bool:
        """Whether tensor `x` can carry a gradient (`_requires_grad` alone is not enough: a grad
        function's integer inputs have it too)."""
        return x._requires_grad and x.dtype in self._floats

    def enter(self, path: str, cls: str, parent: Any, args: tuple) -> tuple | None:
        """At the Cell's entry: the arguments with its differentiable inputs copied (None: unchanged)."""
        self._seq += 1
        call = _Call(self._seq, path, cls, parent)
        new = None
        for i, a in enumerate(args):
            if not isinstance(a, self._tensor):
                continue
            if self._differentiable(a):
                if new is None:
                    new = list(args)
                new[i] = copy = self._copy(a)
                copy.register_hook(self._input_hook(call, len(call.grad_in)))
                call.hooked += 1
            call.grad_in.append(None)
        call.inputs_waiting = call.hooked
        self._entered.setdefault(path, []).append(call)
        self._open[call.seq] = call
        return tuple(new) if new is not None else None

    def leave(self, path: str, args: tuple, out: Any) -> Any:
        """At the Cell's return: hooks its output tensors; the output to return (None: unchanged)."""
        calls = self._entered.get(path)
        if not calls:
            return None
        call = calls.pop()
        tuple_out = isinstance(out, tuple)
        outs = list(out) if tuple_out else [out]
        changed = False
        for i, o in enumerate(outs):
            if not isinstance(o, self._tensor):
                continue
            if self._differentiable(o):
                if any(o is a for a in args):  # its input hook would fire first: a copy of its own
                    outs[i] = o = self._copy(o)
                    changed = True
                o.register_hook(self._output_hook(call, len(call.grad_out)))
                call.outputs_waiting += 1
            call.grad_out.append(None)
        if not call.outputs_waiting and not call.hooked:  # no gradient will reach it
            del self._open[call.seq]
        if not changed:
            return None
        return tuple(outs) if tuple_out else outs[0]

    def _output_hook(self, call: _Call, slot: int):
        def hook(grad):
            call.grad_out[slot] = grad
            call.outputs_waiting -= 1
            if not call.outputs_waiting and not call.hooked and call.seq in self._open:
                self._ready[call.seq] = call

        return hook

    def _input_hook(self, call: _Call, slot: int):
        def hook(grad):
            call.grad_in[slot] = grad
            call.inputs_waiting -= 1
            if not call.inputs_waiting and call.seq in self._open:
                self._emit_ready(after=call.seq)
                self._finish(call)

        return hook

    def _finish(self, call: _Call) -> None:
        del self._open[call.seq]
        self._ready.pop(call.seq, None)
        grad_in = tuple(call.grad_in) if call.hooked else None
        self._emit(call.path, call.cls, grad_in, tuple(call.grad_out), call.parent)

    def _emit_ready(self, after: int = 0) -> None:
        """Hand over the waiting calls without inputs to differentiate entered after call `after`."""
        for seq in sorted(s for s in self._ready if s > after):
            self._finish(self._ready[seq])

    def end_pass(self) -> None:
        """A pipeline pass ends: every call some gradient reached is done, in call order."""
        for call in list(self._open.values()):
            if any(g is not None for g in call.grad_out) or any(g is not None for g in call.grad_in):
                self._finish(call)

    def flush(self) -> None:
        """The step ends: emit what `end_pass` would; forget the calls no gradient reached."""
        self.end_pass()
        self._open.clear()
        self._ready.clear()
        self._entered.clear()


__all__ = ["GradTaps"]
