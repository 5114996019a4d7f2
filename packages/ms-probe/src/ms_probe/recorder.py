"""The framework-neutral heart of the dumpers: names, call counters, filters, and what goes in
each dump.json entry. The MindSpore and PyTorch dumpers only turn hook calls into calls here,
through a small adapter that knows their tensor type.

Forward items are written when the module returns (children before parents, as msprobe does);
their inputs are read when it is entered, so an in-place change inside the module does not leak
into its dumped input. Backward items take the gradients w.r.t. the outputs as `input` and
those w.r.t. the inputs as `output` (msprobe's convention).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .config import DumpConfig
from .naming import api_item, module_item, param_grad_item
from .stacks import call_stack
from .stats import scalar_info, tensor_info
from .stats_cache import StatsCache
from .stats_worker import StatsWorker
from .writer import DumpWriter

log = logging.getLogger("ms_probe")


class Adapter(Protocol):
    """What the recorder needs to know about a framework's tensors."""

    framework: str
    prefix: str
    type_name: str

    def is_tensor(self, x: Any) -> bool: ...
    def to_numpy(self, x: Any) -> np.ndarray: ...
    def dtype_name(self, x: Any) -> str: ...
    def requires_grad(self, x: Any) -> bool | None: ...
    def other_info(self, x: Any) -> dict[str, Any] | None: ...

    # Optional: a hashable key of the tensor's values (data address, shape, strides, dtype,
    # version), or None; an adapter without it gets no statistics cache (stats_cache.py).
    # def storage_key(self, x: Any) -> Hashable | None: ...


@dataclass
class _Frame:
    """A module call in progress."""

    name: str
    path: str
    parent: str | None
    selected: bool
    listed: bool
    cls: str = ""
    entry: dict[str, Any] = field(default_factory=dict)
    stack: tuple[str, ...] | None = None


class Recorder:
    """One rank's dump state across steps."""

    def __init__(self, config: DumpConfig, adapter: Adapter, rank: int):
        self.cfg, self.adapter, self.rank = config, adapter, rank
        self.step = 0
        self.enabled = False
        self.writer: DumpWriter | None = None
        self.events_in_step = 0
        self.dumped_steps: list[int] = []
        self._stats: StatsWorker | None = None  # async_dump: started at the first tensor
        self._storage_key = getattr(adapter, "storage_key", None)
        self.stats_cache = StatsCache()
        self._reset_step_state()

    # ------------------------------------------------------------------ steps
    def _reset_step_state(self) -> None:
        self.stats_cache.clear()
        self.fwd_count: Counter = Counter()
        self.bwd_count: Counter = Counter()
        self.api_count: Counter = Counter()
        self.pgrad_count: Counter = Counter()
        self.stack: list[_Frame] = []
        self.pending_grads: dict[str, tuple[str, int, dict[str, Any]]] = {}
        self.scope_state = 0 if self.cfg.scope else 1
        self.events_in_step = 0
        self.where: dict[str, Any] | None = None  # the pipeline pass running now (pipeline_pass)
        self._grad_where: dict[str, dict[str, Any] | None] = {}  # where each pending parameter gradient arrived
        # path -> (path, class) of the module that called it: a backward item's parent is the
        # backward of its caller, not of a container that is never called (a CellList)
        self.caller: dict[str, tuple[str, str] | None] = {}

    @property
    def step_selected(self) -> bool:
        return (not self.cfg.step or self.step in self.cfg.step) and (not self.cfg.rank or self.rank in self.cfg.rank)

    @property
    def active(self) -> bool:
        """Hooks record only between start() and stop() of a selected step on a selected rank."""
        return self.enabled and self.writer is not None

    @property
    def rank_dir(self) -> str:
        return os.path.join(self.cfg.dump_path, f"step{self.step}", f"rank{self.rank}")

    def start(self) -> None:
        self.enabled = True
        if self.step_selected and self.writer is None:
            self.writer = DumpWriter(
                self.rank_dir, task=self.cfg.task, level=self.cfg.level, framework=self.adapter.framework
            )

    def stop(self) -> str | None:
        """Stop recording and write this step's JSON files (again, if start/stop ran twice in a step)."""
        self.enabled = False
        if self.writer is None:
            return None
        self._flush_pending_grads()
        if self._stats is not None:
            self._stats.drain()
        self.stats_cache.clear()  # the tensors may change before a later start()
        if not self.writer.data:
            msg = (
                f"step {self.step} rank {self.rank}: no module or API call was recorded between start() and stop(): "
                "the model did not run, or it ran compiled (mindspore.jit or GRAPH_MODE with jit='boundary'), "
                "where hooks record nothing; jit='pynative' (the default) runs dumped steps eagerly"
            )
            self.writer.warn(msg)
            log.warning("ms-probe: %s", msg)
        path = str(self.writer.flush())
        if self.step not in self.dumped_steps:
            self.dumped_steps.append(self.step)
        return path

    def next_step(self) -> None:
        if self.enabled:
            self.stop()
        self.writer = None
        self.step += 1
        self._reset_step_state()

    # ------------------------------------------------------------------ filters
    def _listed(self, name: str) -> bool:
        return not self.cfg.list or any(tok in name for tok in self.cfg.list)

    def _begin(self, name: str) -> bool:
        """Scope bookkeeping at an item's start; True when the scope is open."""
        if self.scope_state == 0 and name == self.cfg.scope[0]:
            self.scope_state = 1
        return self.scope_state == 1

    def _end(self, name: str) -> None:
        if self.cfg.scope and self.scope_state == 1 and name == self.cfg.scope[1]:
            self.scope_state = 2

    def _tensors_for(self, name: str) -> bool:
        return self.cfg.task == "tensor" or any(tok in name for tok in self.cfg.tensor_list)

    # ------------------------------------------------------------------ capture
    def capture(self, value: Any, data_name: str, tensors: bool) -> Any:
        """The dump.json form of a (nested) value; tensors also go to .npy when `tensors`."""
        a = self.adapter
        if a.is_tensor(value):
            return self._tensor_record(value, data_name, tensors)
        if isinstance(value, Mapping):
            return {str(k): self.capture(v, f"{data_name}.{k}", tensors) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.capture(v, f"{data_name}.{i}", tensors) for i, v in enumerate(value)]
        other = a.other_info(value)
        return other if other is not None else scalar_info(value)

    def _tensor_record(self, value: Any, data_name: str, tensors: bool) -> dict[str, Any]:
        """One tensor's record. A tensor already seen in this step (same storage key: a module's
        output that is the next one's input) gets a copy of the first record's statistics."""
        a = self.adapter
        later = self.cfg.async_dump and not tensors and self.cfg.summary_mode == "statistics"
        key = self._storage_key(value) if self._storage_key is not None else None
        seen = self.stats_cache.get(key) if key is not None else None
        if seen is not None:
            if not later and self._stats is not None:
                self._stats.drain()  # `seen` may still be waiting for the worker
            info = dict(seen)
            info["shape"] = list(seen["shape"])
            if later:  # the worker fills records in order: `seen` before this copy
                self._worker().submit(info, None, seen)
            if tensors:
                info["data_name"] = self.writer.save_tensor(data_name, a.to_numpy(value))
            return info
        arr = a.to_numpy(value)
        info = tensor_info(
            arr,
            type_name=a.type_name,
            dtype_name=a.dtype_name(value),
            summary_mode=self.cfg.summary_mode,
            requires_grad=a.requires_grad(value),
            statistics=not later,
        )
        if key is not None:  # the tensor is kept alive with it: its address is not reused meanwhile
            self.stats_cache.put(key, info if later else dict(info), value)
        if later:  # async_dump: the worker thread fills the statistics; the tensor lives until then
            self._worker().submit(info, arr, value)
        elif tensors:
            info["data_name"] = self.writer.save_tensor(data_name, arr)
        return info

    def _worker(self) -> StatsWorker:
        if self._stats is None:
            self._stats = StatsWorker()
        return self._stats

    def _capture_inputs(self, name: str, args: tuple, kwargs: dict, tensors: bool) -> dict[str, Any]:
        return {
            "input_args": [self.capture(v, f"{name}.input.{i}", tensors) for i, v in enumerate(args)],
            "input_kwargs": {k: self.capture(v, f"{name}.input.{k}", tensors) for k, v in (kwargs or {}).items()},
        }

    def _capture_outputs(self, name: str, out: Any, tensors: bool, key: str = "output") -> list:
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        return [self.capture(v, f"{name}.{key}.{i}", tensors) for i, v in enumerate(outs)]

    # ------------------------------------------------------------------ module hooks
    def _rerun(self) -> bool:
        """Inside a pipeline's B or W: a forward there re-runs one for its gradients (not the step's)."""
        return self.where is not None and self.where["pass"] != "F"

    def _repeated_in_w(self, path: str) -> bool:
        """Inside a pipeline's W, a module gradient its B already recorded for this microbatch (W
        differentiates again for the weights). A first stage's B computes no input gradient, so
        there W's are the only ones."""
        where = self.where
        return where is not None and where["pass"] == "W" and self.bwd_count[path] > where["microbatch"]

    def forward_pre(self, path: str, cls: str, args: tuple, kwargs: dict | None) -> None:
        if not self.active or self._rerun():
            return
        self.events_in_step += 1
        name = module_item(self.adapter.prefix, path, cls, "forward", self.fwd_count[path])
        self.fwd_count[path] += 1
        in_scope = self._begin(name)
        # In mix, a listed module brings everything that runs inside it (msprobe's rule).
        inherited = self.cfg.level == "mix" and any(f.listed for f in self.stack)
        listed = bool(self.cfg.list) and (self._listed(name) or inherited)
        chosen = self._listed(name) or inherited
        selected = in_scope and chosen and self.cfg.level in ("L0", "mix") and self.cfg.wants("forward", "")
        frame = _Frame(name, path, self.stack[-1].name if self.stack else None, selected, listed, cls)
        self.caller[path] = (self.stack[-1].path, self.stack[-1].cls) if self.stack else None
        if selected:
            frame.stack = call_stack(3)
            if self.cfg.task != "structure" and self.cfg.wants("forward", "input"):
                frame.entry.update(self._capture_inputs(name, args, kwargs, self._tensors_for(name)))
        self.stack.append(frame)

    def forward_post(self, path: str, out: Any, params: list[tuple[str, Any]]) -> None:
        if not self.active or self._rerun():
            return
        # Pop to this module's frame: a module that raised never reached its post hook.
        while self.stack and self.stack[-1].path != path:
            self.stack.pop()
        if not self.stack:
            return
        frame = self.stack.pop()
        if frame.selected:
            tensors = self._tensors_for(frame.name)
            entry = frame.entry
            if self.cfg.task != "structure":
                if self.cfg.wants("forward", "output"):
                    entry["output"] = self._capture_outputs(frame.name, out, tensors)
                if params and self.cfg.wants("forward", "input"):
                    entry["parameters"] = {
                        p: self.capture(v, f"{frame.name}.parameters.{p}", tensors) for p, v in params
                    }
            parent = frame.parent if self.cfg.level != "L1" else None
            self.writer.add(frame.name, entry, parent, frame.stack, self.where)
        self._end(frame.name)

    def backward(self, path: str, cls: str, grad_input: Any, grad_output: Any, parent: tuple[str, str] | None) -> None:
        if not self.active or self._repeated_in_w(path):
            return
        self.events_in_step += 1
        self._flush_pending_grads(path)
        name = module_item(self.adapter.prefix, path, cls, "backward", self.bwd_count[path])
        self.bwd_count[path] += 1
        in_scope = self._begin(name)
        if in_scope and self._listed(name) and self.cfg.level in ("L0", "mix") and self.cfg.wants("backward", ""):
            tensors, entry = self._tensors_for(name), {}
            if self.cfg.task != "structure":
                if self.cfg.wants("backward", "input"):
                    entry["input"] = self._capture_outputs(name, grad_output, tensors, "input")
                if self.cfg.wants("backward", "output"):
                    entry["output"] = self._capture_outputs(name, grad_input, tensors, "output")
            parent_name = None
            parent = self.caller.get(path, parent)  # the static parent when its forward was not seen
            if parent is not None:
                # the parent's coming backward; its last one when it already ran (a caller whose
                # inputs are integer ids finishes its backward before its embedding's)
                index = self.bwd_count[parent[0]]
                if self.fwd_count[parent[0]]:
                    index = min(index, self.fwd_count[parent[0]] - 1)
                parent_name = module_item(self.adapter.prefix, parent[0], parent[1], "backward", index)
            self.writer.add(name, entry, parent_name, None, self.where)
        self._end(name)

    def param_grad(self, path: str, cls: str, pname: str, grad: Any, expected: int) -> None:
        """One parameter's gradient; the cell's parameters_grad item is written once all `expected` arrived."""
        if not self.active:
            return
        self.events_in_step += 1
        if path in self.pending_grads and pname in self.pending_grads[path][2]:
            self._flush_pending_grads(path)
        name = param_grad_item(self.adapter.prefix, path, cls, self.pgrad_count[path])
        wanted = self._listed(name) and self.cfg.level in ("L0", "mix") and self.cfg.wants("backward", "output")
        wanted = wanted and self.scope_state == 1
        _, _, got = self.pending_grads.setdefault(path, (cls, expected, {}))
        self._grad_where[path] = self.where
        got[pname] = [self.capture(grad, f"{name}.{pname}", self._tensors_for(name))] if wanted else None
        if len(got) >= expected:
            self._flush_pending_grads(path)

    def _flush_pending_grads(self, only: str | None = None) -> None:
        for path in [only] if only is not None else list(self.pending_grads):
            if path not in self.pending_grads:
                continue
            cls, _, got = self.pending_grads.pop(path)
            name = param_grad_item(self.adapter.prefix, path, cls, self.pgrad_count[path])
            self.pgrad_count[path] += 1
            entry = {p: v for p, v in got.items() if v is not None}
            if entry or (got and self.cfg.task == "structure"):
                owner = module_item(self.adapter.prefix, path, cls, "backward", self.bwd_count[path])
                self.writer.add(name, entry, owner, None, self._grad_where.pop(path, None))

    # ------------------------------------------------------------------ compiled steps (dump_graph)
    def _module_selected(self, name: str, direction: str) -> bool:
        return self._listed(name) and self.cfg.level in ("L0", "mix") and self.cfg.wants(direction, "")

    def graph_forward(self, path: str, name: str, args: list, outs: list, params: list, parent: str | None) -> None:
        """A forward item of a compiled step, from its probes' values (numpy arrays)."""
        self.events_in_step += 1
        if self._begin(name) and self._module_selected(name, "forward"):
            tensors, entry = self._tensors_for(name), {}
            if self.cfg.task != "structure":
                if self.cfg.wants("forward", "input"):
                    entry.update(self._capture_inputs(name, tuple(args), {}, tensors))
                if self.cfg.wants("forward", "output"):
                    entry["output"] = self._capture_outputs(name, outs, tensors)
                if params and self.cfg.wants("forward", "input"):
                    entry["parameters"] = {p: self.capture(v, f"{name}.parameters.{p}", tensors) for p, v in params}
            self.writer.add(name, entry, parent, None)
        self._end(name)

    def graph_backward(self, name: str, grads_out: list, grads_in: list, parent: str | None) -> None:
        """A backward item of a compiled step: gradients of the outputs (its input) and of the inputs."""
        self.events_in_step += 1
        if self._begin(name) and self._module_selected(name, "backward"):
            tensors, entry = self._tensors_for(name), {}
            if self.cfg.task != "structure":
                if self.cfg.wants("backward", "input"):
                    entry["input"] = self._capture_outputs(name, grads_out, tensors, "input")
                if self.cfg.wants("backward", "output"):
                    entry["output"] = self._capture_outputs(name, grads_in, tensors, "output")
            self.writer.add(name, entry, parent, None)
        self._end(name)

    def graph_param_grads(self, name: str, grads: dict, owner: str) -> None:
        """A Cell's parameters_grad item of a compiled step."""
        self.events_in_step += 1
        if self._listed(name) and self.cfg.level in ("L0", "mix") and self.cfg.wants("backward", "output"):
            if self.scope_state == 1 or not self.cfg.scope:
                tensors = self._tensors_for(name)
                entry = {p: [self.capture(g, f"{name}.{p}", tensors)] for p, g in grads.items()}
                self.writer.add(name, entry, owner, None)

    # ------------------------------------------------------------------ API calls (L1 / mix)
    def api_call(self, prefix: str, api: str, args: tuple, kwargs: dict, out: Any, stack: tuple[str, ...] | None):
        if not self.active or self.cfg.level == "L0":
            return
        self.events_in_step += 1
        name = api_item(prefix, api, self.api_count[(prefix, api)])
        self.api_count[(prefix, api)] += 1
        in_scope = self._begin(name)
        listed = self._listed(name) or any(f.listed for f in self.stack)
        if in_scope and listed and self.cfg.wants("forward", ""):
            tensors, entry = self._tensors_for(name), {}
            if self.cfg.task != "structure":
                if self.cfg.wants("forward", "input"):
                    entry.update(self._capture_inputs(name, args, kwargs, tensors))
                if self.cfg.wants("forward", "output"):
                    entry["output"] = self._capture_outputs(name, out, tensors)
            parent = self.stack[-1].name if (self.stack and self.cfg.level == "mix") else None
            self.writer.add(name, entry, parent, stack)
        self._end(name)
