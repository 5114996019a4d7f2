"""The PyTorch dumper: module forward hooks and full backward hooks (level L0), every torch API
call through a TorchFunctionMode (L1/mix) and parameter-gradient hooks, feeding the same Recorder
as MindSpore, so both write the same format (`Module.` instead of `Cell.`).
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any

import numpy as np

from .recorder import Recorder
from .stacks import call_stack

# Torch warns once per module whose output is not a tensor (HF ModelOutput) or whose inputs need no
# grad; both are expected here and say nothing to the user.
_QUIET = (
    r"For backward hooks to be called, module output should be a Tensor",
    r"Full backward hook is firing when gradients are computed with respect to module outputs",
)
_HOOKS_FILE = os.path.join("torch", "utils", "hooks.py")
# Tensor attribute reads and bookkeeping calls that TorchFunctionMode also sees; not APIs worth a row.
_SKIP_APIS = {"__get__", "__set__", "dim", "size", "numel", "is_floating_point", "is_complex", "__len__", "stride"}


def _worth_a_row(name: str, out: Any, adapter: TorchAdapter) -> bool:
    """Public APIs and operators (dunders) that return a tensor."""
    if name in _SKIP_APIS or (name.startswith("_") and not (name.startswith("__") and name.endswith("__"))):
        return False
    if isinstance(out, (tuple, list)):
        return any(adapter.is_tensor(o) for o in out)
    return adapter.is_tensor(out)


def _tensor_leaves(x: Any, tensor_type: type) -> list[Any]:
    if isinstance(x, tensor_type):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensor_leaves(v, tensor_type)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensor_leaves(v, tensor_type)]
    return []


def _hookable_output(out: Any, tensor_type: type) -> bool:
    """Whether torch's full backward hook will see this output (a tensor or a plain tuple of them)."""
    if isinstance(out, tensor_type):
        return True
    return type(out) in (tuple, list) and all(isinstance(o, tensor_type) or o is None for o in out)


class TorchAdapter:
    """PyTorch tensors for the Recorder."""

    framework = "pytorch"
    prefix = "Module"
    type_name = "torch.Tensor"

    def __init__(self):
        import torch

        self.torch = torch

    def is_tensor(self, x: Any) -> bool:
        return isinstance(x, self.torch.Tensor)

    def to_numpy(self, x: Any) -> np.ndarray:
        t = x.detach()
        if t.dtype == self.torch.bfloat16:
            t = t.float()
        return t.cpu().numpy()

    def dtype_name(self, x: Any) -> str:
        return str(x.dtype)

    def requires_grad(self, x: Any) -> bool | None:
        return bool(x.requires_grad)

    def storage_key(self, x: Any) -> tuple | None:
        """What identifies the tensor's values now (stats_cache.py): address, shape, strides, dtype,
        device, `_version` (counts in-place updates) and requires_grad (part of the record)."""
        try:
            return (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x.device, x._version, x.requires_grad)
        except (AttributeError, RuntimeError, TypeError, ValueError):  # no storage (meta, sparse)
            return None

    def other_info(self, x: Any) -> dict[str, Any] | None:
        if isinstance(x, self.torch.dtype):
            return {"type": "torch.dtype", "value": str(x)}
        if isinstance(x, self.torch.device):
            return {"type": "torch.device", "value": str(x)}
        return None


def _is_functional(func: Any, name: str) -> bool:
    import torch.nn.functional as F

    return getattr(F, name, None) is func


def api_prefix_and_name(func: Any) -> tuple[str, str]:
    """msprobe's prefix for a torch callable: Tensor methods, Functional (torch.nn.functional), Torch."""
    name = getattr(func, "__name__", None) or type(func).__name__
    objclass = getattr(func, "__objclass__", None)
    module = getattr(func, "__module__", "") or ""
    if objclass is not None and objclass.__name__ in ("TensorBase", "Tensor", "_TensorBase"):
        return "Tensor", name
    if module.startswith("torch._tensor") or getattr(func, "__qualname__", "").startswith("Tensor."):
        return "Tensor", name
    if module == "torch.nn.functional" or _is_functional(func, name):
        return "Functional", name
    return "Torch", name


class TorchDumper:
    """Hooks every sub-module of `models` (the models themselves are not dumped, as in msprobe)."""

    def __init__(self, recorder: Recorder, models: list[tuple[str, Any]]):
        self.recorder = recorder
        self.models = models
        self.handles: list[Any] = []
        self.plan: list[tuple[Any, str, str, tuple[str, str] | None]] = []
        self.jit_cells: list[str] = []
        self._local = threading.local()
        self._mode = None
        import torch

        self.torch_tensor = torch.Tensor
        self._filters: list[tuple] = []

    def attach(self) -> None:
        """Plan which modules get hooks; the hooks go in at on_start() and out at on_stop(), so steps
        that are not dumped run the model untouched."""
        for prefix, model in self.models:
            modules = dict(model.named_modules())
            for name, module in modules.items():
                if not name:
                    continue
                path = f"{prefix}.{name}" if prefix else name
                parent_name = name.rsplit(".", 1)[0] if "." in name else ""
                parent = None
                if parent_name and parent_name in modules:
                    parent = (f"{prefix}.{parent_name}" if prefix else parent_name, type(modules[parent_name]).__name__)
                self.plan.append((module, path, type(module).__name__, parent))

    def _guarded(self, fn, *args) -> None:
        if self.recorder.active and not getattr(self._local, "busy", False):
            self._local.busy = True
            try:
                fn(*args)
            finally:
                self._local.busy = False

    def _hook_module(self, module, path: str, cls: str, parent: tuple[str, str] | None) -> None:
        rec = self.recorder
        own_params = list(module.named_parameters(recurse=False))

        def pre(m, args, kwargs):
            self._guarded(rec.forward_pre, path, cls, args, kwargs)

        def post(m, args, out):
            self._guarded(rec.forward_post, path, out, own_params)
            if rec.active and not _hookable_output(out, self.torch_tensor):
                self._output_grad_hooks(out, path, cls, parent)

        def bwd(m, grad_input, grad_output):
            self._guarded(rec.backward, path, cls, grad_input, grad_output, parent)

        self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self.handles.append(module.register_forward_hook(post))
        self.handles.append(module.register_full_backward_hook(bwd))
        for pname, param in own_params:
            if param.requires_grad:
                self.handles.append(param.register_hook(self._grad_hook(path, cls, pname, len(own_params))))

    def _output_grad_hooks(self, out: Any, path: str, cls: str, parent: tuple[str, str] | None) -> None:
        """Torch runs no full backward hook for a module whose output is not a tensor or a tuple of
        tensors (HF models return a ModelOutput). Its backward item then gets the gradients w.r.t. its
        outputs (msprobe's backward `input`) from tensor hooks; the gradients w.r.t. its inputs stay
        unknown."""
        leaves = [t for t in _tensor_leaves(out, self.torch_tensor) if t.requires_grad]
        if not leaves:
            return
        grads: list[Any] = [None] * len(leaves)
        pending = [len(leaves)]

        def make(i: int):
            def hook(g):
                grads[i] = g
                pending[0] -= 1
                if pending[0] == 0:
                    self._guarded(self.recorder.backward, path, cls, (), tuple(grads), parent)

            return hook

        for i, t in enumerate(leaves):
            t.register_hook(make(i))

    def _grad_hook(self, path: str, cls: str, pname: str, expected: int):
        def hook(grad):
            self._guarded(self.recorder.param_grad, path, cls, pname, grad, expected)

        return hook

    def detach(self) -> None:
        self.on_stop()

    # ------------------------------------------------------------------ API level through TorchFunctionMode
    def on_start(self) -> None:
        if not self.recorder.step_selected:
            return
        if not self.handles:
            for message in _QUIET:
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
                self._filters.append(warnings.filters[0])
            for module, path, cls, parent in self.plan:
                self._hook_module(module, path, cls, parent)
        if self.recorder.cfg.level not in ("L1", "mix") or self._mode is not None:
            return
        from torch.overrides import TorchFunctionMode

        dumper = self

        class _ApiMode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                local = dumper._local
                # Calls made by torch's own backward-hook machinery are not the model's.
                caller = sys._getframe(1).f_code.co_filename
                if dumper.recorder.active and not getattr(local, "busy", False) and not caller.endswith(_HOOKS_FILE):
                    prefix, name = api_prefix_and_name(func)
                    if _worth_a_row(name, out, dumper.recorder.adapter):
                        local.busy = True
                        try:
                            dumper.recorder.api_call(prefix, name, args, kwargs, out, call_stack(2))
                        finally:
                            local.busy = False
                return out

        self._mode = _ApiMode()
        self._mode.__enter__()

    def on_stop(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for f in self._filters:
            if f in warnings.filters:
                warnings.filters.remove(f)
        self._filters.clear()
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
