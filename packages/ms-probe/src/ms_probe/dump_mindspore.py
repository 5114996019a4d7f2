"""The MindSpore dumper: PyNative Cell forward hooks (level L0) with backward items from tensor
hooks (grad_taps.py), wrapped functional ops (L1/mix) and parameter-gradient hooks, feeding the
framework-neutral Recorder.

mindspore.jit (measured on MindSpore 2.10 CPU, see docs/ms-probe.md): when a jit function calls a
hooked Cell, MindSpore compiles the hooks into the graph, and a hook that does real work (a
try/finally, numpy, I/O) fails to compile ("Unsupported statement 'Try'"); simpler hooks are run at
compile time only, so they record nothing. Hence:
- hooks exist only between start() and stop() of a dumped step: other steps, jit or not, never see them;
- `jit="pynative"` (the default) runs the dumped steps eagerly: MindSpore's jit wrapper calls the plain
  Python function when the environment variable MS_JIT is "0" (read at each call), and a GRAPH_MODE
  context is switched to PyNative for the step and back, so every Cell is dumped;
- `jit="boundary"` keeps jit code compiled: Cells whose own `construct` is jit-decorated are dumped at
  their boundary (their hook fires outside the graph) and nothing below them is hooked. A whole step
  under jit cannot be dumped this way.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from .errors import ProbeError
from .grad_taps import GradTaps
from .recorder import Recorder
from .stacks import call_stack

log = logging.getLogger("ms_probe")

# Functional APIs wrapped at level L1/mix: (module path, msprobe prefix). Only plain Python functions
# are wrapped; primitives called through `ops.operations` are not.
API_NAMESPACES = (
    ("mindspore.ops", "Functional"),
    ("mindspore.mint", "Mint"),
    ("mindspore.mint.nn.functional", "MintFunctional"),
)
TENSOR_METHODS = (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__matmul__", "__pow__", "__neg__", "__getitem__", "matmul", "mean", "sum", "exp", "log", "sqrt",
    "rsqrt", "pow", "abs", "max", "min", "softmax", "astype", "float",
)  # fmt: skip


def is_jit_function(fn: Any) -> bool:
    """Whether `fn` (a function or bound method) is wrapped by mindspore.jit."""
    fn = getattr(fn, "__func__", fn)
    return bool(getattr(fn, "__wrapped_by_jit__", False))


class MindSporeDumper:
    """Hooks every sub-cell of `models` (the models themselves are not dumped, as in msprobe)."""

    def __init__(self, recorder: Recorder, models: list[tuple[str, Any]]):
        self.recorder = recorder
        self.models = models
        self.handles: list[Any] = []
        self.plan: list[tuple[Any, str, str, tuple[str, str] | None]] = []
        self.jit_cells: list[str] = []
        self._patched: list[tuple[Any, str, Any]] = []
        self._local = threading.local()
        self._switched = False
        self._saved_env: str | None = None
        self._saved_mode: int | None = None
        self._taps: GradTaps | None = None  # the Cells' backward items (hooks on their tensors)
        self.graph = None  # jit="graph": the probes of the step being dumped (dump_graph.GraphProbes)

    # ------------------------------------------------------------------ attach / detach
    def attach(self) -> None:
        """Plan which cells get hooks; the hooks themselves go in at on_start()."""
        for prefix, model in self.models:
            self._attach_model(prefix, model)
        if self.jit_cells:
            log.warning(
                "ms-probe: %d Cell(s) have a mindspore.jit construct (%s%s): with jit=%r only their inputs and outputs "
                "are dumped, not the cells inside them%s",
                len(self.jit_cells),
                ", ".join(self.jit_cells[:3]),
                ", ..." if len(self.jit_cells) > 3 else "",
                self.recorder.cfg.jit,
                "; jit='pynative' dumps them too" if self.recorder.cfg.jit == "boundary" else "",
            )

    def _attach_model(self, prefix: str, model: Any) -> None:
        import mindspore as ms

        if is_jit_function(type(model).construct) and self.recorder.cfg.jit == "boundary":
            self.jit_cells.append(prefix or type(model).__name__)
        names = dict(model.cells_and_names())
        blocked: list[str] = []
        for name, cell in names.items():
            if not name:
                continue
            path = f"{prefix}.{name}" if prefix else name
            if any(name.startswith(b + ".") for b in blocked):
                continue  # below a jit construct: the hooks would never fire and may break compilation
            if is_jit_function(type(cell).construct) and self.recorder.cfg.jit == "boundary":
                self.jit_cells.append(path)
                blocked.append(name)
            parent_name = name.rsplit(".", 1)[0] if "." in name else ""
            parent = None
            if parent_name and parent_name in names:
                parent_path = f"{prefix}.{parent_name}" if prefix else parent_name
                parent = (parent_path, type(names[parent_name]).__name__)
            self.plan.append((cell, path, type(cell).__name__, parent))
        if ms.get_context("mode") == ms.GRAPH_MODE and self.recorder.cfg.jit == "boundary":
            log.warning(
                "ms-probe: MindSpore is in GRAPH_MODE, where Cell hooks never fire: the dump will be empty; "
                "use PrecisionDebugger(jit='pynative') to run the dumped steps in PyNative"
            )

    def _hook_cell(self, cell, path: str, cls: str, parent: tuple[str, str] | None) -> None:
        rec = self.recorder
        local = self._local
        taps = self._taps

        # Plain closures without default arguments: MindSpore parses hooks when it compiles a jit
        # graph, and a default argument made that parse fail (measured).
        def pre(c, args, kwargs):
            if not rec.active:
                return None
            if not getattr(local, "busy", False):
                local.busy = True
                try:
                    rec.forward_pre(path, cls, args, kwargs)
                finally:
                    local.busy = False
            copied = taps.enter(path, cls, parent, args)  # also in a pipeline's re-run forward: its B's items
            return None if copied is None else (copied, kwargs)

        def post(c, args, out):
            if not rec.active:
                return None
            if not getattr(local, "busy", False):
                local.busy = True
                try:
                    rec.forward_post(path, out, list(own_params))
                finally:
                    local.busy = False
            return taps.leave(path, args, out)

        own_params = [(p.name.rsplit(".", 1)[-1], p) for p in cell.get_parameters(expand=False)]
        self.handles.append(cell.register_forward_pre_hook(pre, with_kwargs=True))
        self.handles.append(cell.register_forward_hook(post))
        for pname, param in own_params:
            if param.requires_grad:
                self.handles.append(param.register_hook(self._grad_hook(path, cls, pname, len(own_params))))

    def _backward_item(self, path: str, cls: str, grad_input: tuple, grad_output: tuple, parent) -> None:
        """A Cell call's gradients, complete (GradTaps)."""
        if self.recorder.active:
            self._local.busy = True
            try:
                self.recorder.backward(path, cls, grad_input, grad_output, parent)
            finally:
                self._local.busy = False

    def _grad_hook(self, path: str, cls: str, pname: str, expected: int):
        rec = self.recorder

        def hook(grad):
            if rec.active:
                rec.param_grad(path, cls, pname, grad, expected)

        return hook

    def _patch_apis(self) -> None:
        import importlib
        import types

        import mindspore as ms

        for module_name, prefix in API_NAMESPACES:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            for attr in dir(module):
                fn = getattr(module, attr, None)
                if attr.startswith("_") or not isinstance(fn, types.FunctionType) or is_jit_function(fn):
                    continue
                self._patch(module, attr, self._wrap(fn, prefix, attr))
        for attr in TENSOR_METHODS:
            fn = getattr(ms.Tensor, attr, None)
            if fn is not None:
                self._patch(ms.Tensor, attr, self._wrap(fn, "Tensor", attr))

    def _patch(self, owner: Any, attr: str, new: Any) -> None:
        self._patched.append((owner, attr, owner.__dict__.get(attr, _MISSING)))
        setattr(owner, attr, new)

    def _wrap(self, fn, prefix: str, api: str):
        rec, local = self.recorder, self._local

        def wrapper(*args, **kwargs):
            if not rec.active or getattr(local, "busy", False):
                return fn(*args, **kwargs)
            local.busy = True  # nested API calls inside this one are not dumped (msprobe keeps the outermost)
            try:
                out = fn(*args, **kwargs)
                rec.api_call(prefix, api, args, kwargs, out, call_stack(2))
            finally:
                local.busy = False
            return out

        wrapper.__wrapped__ = fn
        wrapper.__name__ = getattr(fn, "__name__", api)
        return wrapper

    def _remove_hooks(self) -> None:
        for h in self.handles:
            try:
                h.remove()
            except Exception:
                pass
        self.handles.clear()

    def detach(self) -> None:
        self.on_stop()
        self._remove_hooks()
        for owner, attr, old in reversed(self._patched):
            if old is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)
        self._patched.clear()

    # ------------------------------------------------------------------ jit handling per step
    def on_start(self) -> None:
        if not self.recorder.step_selected:
            return
        if self.recorder.cfg.jit == "graph":
            self._start_graph()
            return
        if not self.handles:
            self._taps = GradTaps(self._backward_item)
            for cell, path, cls, parent in self.plan:
                self._hook_cell(cell, path, cls, parent)
        if self.recorder.cfg.level in ("L1", "mix") and not self._patched:
            self._patch_apis()
        if self.recorder.cfg.jit != "pynative":
            return
        import mindspore as ms

        self._switched = True
        self._saved_env = os.environ.get("MS_JIT")
        os.environ["MS_JIT"] = "0"
        if ms.get_context("mode") == ms.GRAPH_MODE:
            self._saved_mode = ms.GRAPH_MODE
            ms.set_context(mode=ms.PYNATIVE_MODE)

    def _start_graph(self) -> None:
        """jit="graph": probes compiled into the step (:mod:`.dump_graph`), no mode switch."""
        import mindspore as ms

        from .dump_graph import GraphProbes

        device = ms.get_context("device_target")
        if device not in ("CPU", "Ascend"):
            raise ProbeError(
                f"jit='graph' probes with pyfunc ops (CPU) or ops.tensordump (Ascend), not on {device}; "
                "use jit='pynative'"
            )
        if self.graph is None:
            if self.recorder.cfg.level in ("L1", "mix"):
                log.warning("ms-probe: jit='graph' dumps Cells only (level L0); functional ops are not wrapped")
            # Ascend: ops.tensordump probes write into a private folder beside the dump (dump_graph.py)
            dump_dir = None
            if device == "Ascend":
                dump_dir = os.path.join(self.recorder.cfg.dump_path, f".tensordump-rank{self.recorder.rank}")
            self.graph = GraphProbes(self.recorder, self.plan, dump_dir)
            self.graph.install()
        self.graph.start()

    def end_pass(self) -> None:
        """A pipeline pass ends (PrecisionDebugger.pipeline_pass)."""
        if self._taps is not None:
            self._taps.end_pass()

    def on_stop(self) -> None:
        if self._taps is not None:
            self._taps.flush()
        if self.graph is not None:
            self.graph.emit()
            self.graph.remove()
            self.graph = None
        self._remove_hooks()
        for owner, attr, old in reversed(self._patched):
            if old is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)
        self._patched.clear()
        if not self._switched:
            return
        import mindspore as ms

        self._switched = False
        if self._saved_env is None:
            os.environ.pop("MS_JIT", None)
        else:
            os.environ["MS_JIT"] = self._saved_env
        self._saved_env = None
        if self._saved_mode is not None:
            ms.set_context(mode=self._saved_mode)
            self._saved_mode = None


_MISSING = object()
