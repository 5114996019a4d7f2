"""Module-level dump of a compiled step (``jit="graph"``): probes compiled into the graph.

MindSpore 2.10 on CPU, measured (docs/ms-probe.md, "Static graph"): ``ops.TensorDump`` has no CPU
kernel; MindSpore's own kernel dump writes every kernel's tensors but names backward kernels of
cells reused in a loop after one cell only, and refuses statistics on CPU. What works: an
``ops.Custom(func_type="pyfunc")`` identity op runs a Python function on the values as the graph
executes, its ``bprop`` another one on the gradient, and a Cell's ``construct`` is compiled as it
is when the graph is built. So every Cell gets, per tensor argument and per tensor output, an
identity probe: forward it records the value, backward the gradient, and a
hook on each parameter records the parameter's gradient. The records go through the same
Recorder as the PyNative hooks, item names and statistics included, so a graph-mode dump compares
with a PyNative one.

On Ascend the probes are ``ops.tensordump`` calls (MindSpore's in-graph dump op, Ascend only; a
custom ``bprop`` dumps the gradient): each writes ``{tag}_{dtype}_{id}.npy`` into a private
folder as the graph runs, ``id`` a process-wide counter in execution order, and ``emit()`` reads
them back as the same events (:func:`read_tensor_dumps`). That route cannot run here (no Ascend
device; its test is marked ``ascend``); the file parsing is tested on CPU.

Limits: the first four positional arguments and the first two outputs of a Cell are probed (a
tuple output beyond that passes through); a probed Cell's class is a same-named subclass until
``stop()``; the step must be compiled while the probes are on
(:meth:`ms_probe.PrecisionDebugger.jit` returns a fresh ``mindspore.jit`` of the step); probes
record only between ``start()`` and ``stop()``, though a graph compiled with them keeps them.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .naming import module_item, param_grad_item


@dataclass
class _Event:
    """One probe firing: which Cell, what (in, out, grad_in, grad_out, param), which slot, the value."""

    path: str
    kind: str
    slot: Any  # an argument / output index, or a parameter's name
    call: int  # the how-many-th firing of this (path, kind, slot)
    value: np.ndarray


class GraphProbes:
    """Identity probes on every planned Cell and its parameters, and their records."""

    def __init__(self, recorder, plan: list[tuple[Any, str, str, tuple[str, str] | None]], dump_dir: str | None = None):
        self.recorder = recorder
        self.plan = plan
        self.dump_dir = dump_dir
        """Ascend: the folder the tensordump probes write to (None: pyfunc probes, CPU)."""
        self._tags: dict[str, tuple[str, str, Any]] = {}  # file tag -> (path, kind, slot)
        self.handles: list[Any] = []
        self.events: list[_Event] = []
        self._counts: Counter = Counter()
        self.recording = False
        self._params: dict[str, list[tuple[str, Any]]] = {}  # each Cell's own parameters
        self._values: dict[str, list[tuple[str, np.ndarray]]] = {}  # their values when recording began

    # ------------------------------------------------------------------ probes
    def _record(self, path: str, kind: str, slot: Any, value: np.ndarray) -> None:
        if not self.recording:
            return
        key = (path, kind, slot)
        self.events.append(_Event(path, kind, slot, self._counts[key], np.array(value)))
        self._counts[key] += 1

    def _tag(self, path: str, kind: str, slot: Any) -> str:
        """The file a tensordump probe writes (a short tag: module paths are not file names)."""
        tag = f"probe{len(self._tags)}"
        self._tags[tag] = (path, kind, slot)
        return os.path.join(self.dump_dir, tag)

    def _probe(self, path: str, kind: str, slot: int):
        """An identity op recording its value as ``kind`` and its gradient as ``grad_<kind>``."""
        from mindspore import ops

        if self.dump_dir is not None:
            return _tensor_dump_probe(self._tag(path, kind, slot), self._tag(path, "grad_" + kind, slot))

        def backward(g):
            self._record(path, "grad_" + kind, slot, g)
            return g

        def forward(x):
            self._record(path, kind, slot, x)
            return x

        back = ops.Custom(backward, out_shape=_same, out_dtype=_same, func_type="pyfunc")

        def bprop(x, out, dout):
            return (back(dout),)

        return ops.Custom(forward, out_shape=_same, out_dtype=_same, func_type="pyfunc", bprop=bprop)

    def _param_probe(self, path: str, pname: str):
        from mindspore import ops

        if self.dump_dir is not None:
            file = self._tag(path, "param", pname)

            def dump_hook(g):
                ops.tensordump(file, g)
                return g

            return dump_hook

        def grad(g):
            self._record(path, "param", pname, g)
            return g

        op = ops.Custom(grad, out_shape=_same, out_dtype=_same, func_type="pyfunc")

        def hook(g):
            return op(g)

        return hook

    def install(self) -> None:
        """Register the probes (a graph compiled from now on carries them)."""
        for cell, path, _cls, _parent in self.plan:
            self.handles += _register(cell, *(self._probe(path, "in", i) for i in range(4)),
                                      *(self._probe(path, "out", i) for i in range(2)))  # fmt: skip
            own = [(p.name.rsplit(".", 1)[-1], p) for p in cell.get_parameters(expand=False)]
            self._params[path] = own
            for pname, param in own:
                if param.requires_grad:
                    self.handles.append(param.register_hook(self._param_probe(path, pname)))

    def remove(self) -> None:
        for h in self.handles:
            try:
                h.remove()
            except Exception:
                pass
        self.handles.clear()

    def start(self) -> None:
        """Record from now on; the parameters are read now, before the step can update them."""
        self.events.clear()
        self._counts.clear()
        if self.dump_dir is not None:  # what a graph wrote before this step is not this step's
            shutil.rmtree(self.dump_dir, ignore_errors=True)
            os.makedirs(self.dump_dir)
        self._values = {path: [(n, p.asnumpy().copy()) for n, p in own] for path, own in self._params.items()}
        self.recording = True

    # ------------------------------------------------------------------ records -> dump items
    def emit(self) -> None:
        """Wait for the graph, then hand what the probes saw to the Recorder as dump items."""
        _wait_for_graphs()
        self.recording = False
        if self.dump_dir is not None:
            self.events = read_tensor_dumps(
                self.dump_dir, self._tags, settle_s=float(os.environ.get("MS_DUMP_WAIT_TIME", 2))
            )
        rec = self.recorder
        if not rec.active:
            return
        calls: dict[tuple[str, str, int], dict[Any, np.ndarray]] = defaultdict(dict)
        done: dict[tuple[str, str, int], int] = {}  # when each call's last value arrived
        for order, e in enumerate(self.events):
            key = (e.path, e.kind, e.call)
            calls[key][e.slot] = e.value
            done[key] = order
        info = {path: (cls, parent) for _cell, path, cls, parent in self.plan}
        forward = sorted(((p, c) for p, k, c in done if k == "out"), key=lambda pc: done[(pc[0], "out", pc[1])])
        backward = sorted(
            {(p, c) for p, k, c in done if k in ("grad_in", "grad_out")},
            key=lambda pc: max(done.get((pc[0], k, pc[1]), -1) for k in ("grad_in", "grad_out")),
        )
        for path, call in forward:
            cls, parent = info[path]
            name = module_item(rec.adapter.prefix, path, cls, "forward", call)
            rec.graph_forward(
                path, name, _ordered(calls.get((path, "in", call), {})), _ordered(calls[(path, "out", call)]),
                self._values.get(path, []) if call == 0 else [],
                _parent_item(rec, parent, "forward"),
            )  # fmt: skip
        for path, call in backward:
            cls, parent = info[path]
            name = module_item(rec.adapter.prefix, path, cls, "backward", call)
            grads_out = _ordered(calls.get((path, "grad_out", call), {}))
            grads_in = _ordered(calls.get((path, "grad_in", call), {}))
            inputs = calls.get((path, "in", call), {})
            floating = [np.issubdtype(inputs.get(i, g).dtype, np.floating) for i, g in enumerate(grads_in)]
            grads_in = [g if f else None for g, f in zip(grads_in, floating)]
            rec.graph_backward(name, grads_out, grads_in, _parent_item(rec, parent, "backward"))
        for path in {p for p, k, _c in done if k == "param"}:
            cls, _parent = info[path]
            grads = calls[(path, "param", 0)]
            rec.graph_param_grads(
                param_grad_item(rec.adapter.prefix, path, cls, 0),
                grads,
                module_item(rec.adapter.prefix, path, cls, "backward", 0),
            )
        self.events.clear()


def _wait_for_graphs() -> None:
    """Wait until every launched graph ran (its probes with it): a compiled call returns before its
    graph has run. ``mindspore.runtime.synchronize()`` refuses the CPU device in MindSpore 2.10
    ("CPU device is not supported"); the PyNative executor's ``sync`` waits there."""
    import mindspore as ms

    if ms.get_context("device_target") == "CPU":
        from mindspore.graph.api import _pynative_executor

        _pynative_executor.sync()
    else:
        ms.runtime.synchronize()


_DUMP_FILE = re.compile(r"^(?P<tag>probe\d+)_(?P<dtype>[A-Za-z0-9]+)_(?P<id>\d+)\.npy$")


def read_tensor_dumps(folder: str | os.PathLike, tags: dict[str, tuple[str, str, Any]], settle_s: float = 2.0) -> list:
    """The events of the tensordump probes: files ``{tag}_{dtype}_{id}.npy`` (MindSpore's naming
    for mode "out") in ``id`` order, each (path, kind, slot)'s n-th file its call n. TensorDump
    writes asynchronously: the folder is read once it has not changed for ``settle_s`` seconds."""
    folder = Path(folder)
    seen, since = None, time.monotonic()
    while True:
        names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        if names != seen:
            seen, since = names, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            break
        time.sleep(min(0.05, settle_s / 4 or 0.01))
    files = []
    for name in seen:
        m = _DUMP_FILE.match(name)
        if m is not None and m["tag"] in tags:
            files.append((int(m["id"]), m["tag"], name))
    counts: Counter = Counter()
    events = []
    for _id, tag, name in sorted(files):
        path, kind, slot = tags[tag]
        events.append(_Event(path, kind, slot, counts[(path, kind, slot)], np.load(folder / name, allow_pickle=False)))
        counts[(path, kind, slot)] += 1
    return events


def _tensor_dump_probe(file: str, grad_file: str):
    """An identity Cell that dumps its input, and in its bprop the gradient (Ascend graph mode)."""
    from mindspore import nn, ops

    class TensorDumpProbe(nn.Cell):
        def construct(self, x):
            ops.tensordump(file, x)
            return x

        def bprop(self, x, out, dout):
            ops.tensordump(grad_file, dout)
            return (dout,)

    return TensorDumpProbe()


def _same(x):
    """out_shape / out_dtype of an identity op."""
    return x


def _ordered(slots: dict[Any, np.ndarray]) -> list[np.ndarray]:
    """The values of slots 0, 1, ... (a missing slot, a non-tensor argument, ends the list)."""
    out = []
    while len(out) in slots:
        out.append(slots[len(out)])
    return out


def _parent_item(rec, parent: tuple[str, str] | None, direction: str) -> str | None:
    """The parent Cell's item (its first call: a graph runs a Cell's calls in no fixed nesting)."""
    if parent is None or rec.cfg.level == "L1":
        return None
    return module_item(rec.adapter.prefix, parent[0], parent[1], direction, 0)


class _Swapped:
    """The handle of a Cell given a probing subclass: ``remove()`` gives it its class back."""

    def __init__(self, cell, base):
        self.cell, self.base = cell, base

    def remove(self) -> None:
        self.cell.__class__ = self.base


def _register(cell, i0, i1, i2, i3, o0, o1) -> list[Any]:
    """Give ``cell`` a subclass (same name) whose ``construct`` puts the probes on its first four
    tensor arguments and first two tensor outputs. Forward hooks would be simpler, but a graph
    ignores the hooks of Cells it calls by iterating a CellList (measured: the decoder layers of
    ``for layer in self.layers``). Written for MindSpore's graph parser: constant branches only."""
    import mindspore as ms

    base = type(cell)

    def construct(self, *args, **kwargs):
        n = len(args)
        if n == 0:
            out = base.construct(self, **kwargs)
        else:
            a0 = i0(args[0]) if isinstance(args[0], ms.Tensor) else args[0]
            if n == 1:
                out = base.construct(self, a0, **kwargs)
            else:
                a1 = i1(args[1]) if isinstance(args[1], ms.Tensor) else args[1]
                if n == 2:
                    out = base.construct(self, a0, a1, **kwargs)
                else:
                    a2 = i2(args[2]) if isinstance(args[2], ms.Tensor) else args[2]
                    if n == 3:
                        out = base.construct(self, a0, a1, a2, **kwargs)
                    else:
                        a3 = i3(args[3]) if isinstance(args[3], ms.Tensor) else args[3]
                        out = base.construct(self, a0, a1, a2, a3, *args[4:], **kwargs)
        if isinstance(out, tuple):
            if len(out) == 0:
                return out
            b0 = o0(out[0]) if isinstance(out[0], ms.Tensor) else out[0]
            if len(out) == 1:
                return (b0,)
            b1 = o1(out[1]) if isinstance(out[1], ms.Tensor) else out[1]
            return (b0, b1) + out[2:]
        if isinstance(out, ms.Tensor):
            return o0(out)
        return out

    cell.__class__ = type(base.__name__, (base,), {"construct": construct, "__module__": base.__module__})
    return [_Swapped(cell, base)]
