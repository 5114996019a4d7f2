"""PrecisionDebugger: msprobe's Python entry point, one object for MindSpore and PyTorch models.

    debugger = PrecisionDebugger(dump_path="./dump", task="statistics", level="L0")
    for batch in data:
        debugger.start(model)      # hooks go in on the first call; the framework comes from the model
        train_step(batch)          # forward + backward (+ optimizer)
        debugger.stop()            # this step's dump.json, stack.json, construct.json are written
        debugger.step()

or `with debugger.dump_step(model): train_step(batch)`. A config.json in msprobe's format works too:
`PrecisionDebugger(config_path="config.json")`; keyword arguments override its fields.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

from .config import DumpConfig, load_config
from .env import detect_rank
from .errors import ProbeError
from .recorder import Recorder

log = logging.getLogger("ms_probe")


def detect_framework(model: Any) -> str:
    """ "mindspore" for a Cell, "pytorch" for an nn.Module, without importing either framework."""
    if "mindspore" in sys.modules:
        import mindspore

        if isinstance(model, mindspore.nn.Cell):
            return "mindspore"
    if "torch" in sys.modules:
        import torch

        if isinstance(model, torch.nn.Module):
            return "pytorch"
    raise ProbeError(f"start(model): {type(model).__name__} is neither a mindspore.nn.Cell nor a torch.nn.Module")


PIPELINE_PASSES = ("F", "B", "W", "BW")
"""The passes of a pipelined step (ms-pipeline's action kinds)."""


class PrecisionDebugger:
    """Dump module (and optionally API) inputs, outputs and gradients of a training loop."""

    def __init__(
        self,
        config_path: str | None = None,
        task: str | None = None,
        dump_path: str | None = None,
        level: str | None = None,
        step: list | None = None,
        *,
        rank: list | None = None,
        scope: list | None = None,
        list: list | None = None,
        data_mode: list | None = None,
        summary_mode: str | None = None,
        tensor_list: list | None = None,
        jit: str | None = None,
        async_dump: bool | None = None,
    ):
        overrides = dict(
            task=task,
            dump_path=dump_path,
            level=level,
            step=step,
            rank=rank,
            scope=scope,
            list=list,
            data_mode=data_mode,
            summary_mode=summary_mode,
            tensor_list=tensor_list,
            jit=jit,
            async_dump=async_dump,
        )
        if config_path is not None:
            self.config = load_config(config_path, **overrides)
        else:
            if dump_path is None:
                raise ProbeError("PrecisionDebugger needs dump_path= or config_path=")
            self.config = DumpConfig(**{k: v for k, v in overrides.items() if v is not None})
        self.rank = detect_rank()
        self._recorder: Recorder | None = None
        self._dumper = None
        self._models: Any = None

    # ------------------------------------------------------------------ msprobe's API
    def start(self, model: Any = None) -> None:
        """Begin recording this step (hooks are attached on the first call, or when the model changes)."""
        if model is None and self._models is None:
            raise ProbeError(f"level {self.config.level} needs the model: call start(model)")
        if model is not None and model is not self._models:
            self._attach(model)
        self._recorder.start()
        self._dumper.on_start()

    def stop(self) -> str | None:
        """End recording and write this step's JSON files; returns the rank folder (None if not dumped)."""
        if self._recorder is None:
            return None
        self._dumper.on_stop()
        return self._recorder.stop()

    def step(self) -> None:
        """Advance to the next step (call counters restart, as in msprobe)."""
        if self._recorder is not None:
            if self._recorder.enabled:
                self._dumper.on_stop()
            self._recorder.next_step()

    def set_init_step(self, step: int) -> None:
        """Number the next step `step` (for resumed runs)."""
        if step < 0:
            raise ProbeError(f"init step {step} is negative")
        self._ensure_recorder_free()
        self._pending_init_step = step
        if self._recorder is not None:
            self._recorder.step = step

    # ------------------------------------------------------------------ ours
    @contextlib.contextmanager
    def dump_step(self, model: Any = None) -> Iterator[PrecisionDebugger]:
        """start(model) ... stop(); step() around one training step."""
        self.start(model)
        try:
            yield self
        finally:
            self.stop()
            self.step()

    @contextlib.contextmanager
    def pipeline_pass(self, stage: int, microbatch: int, kind: str) -> Iterator[None]:
        """Mark what is recorded inside as one pass of a pipelined step: ``kind`` "F", "B", "W" or
        "BW" of ``microbatch`` on ``stage`` (ms-pipeline's PipelineRuntime(probe=debugger) calls
        it around each of its computations). Each item gets its stage, microbatch and pass in the
        rank's pipeline.json; forwards run inside B, W or BW (re-run for gradients) are not
        recorded, nor module gradients inside W that its B already recorded (W differentiates again
        for the weights only).
        A stage runs its microbatches' F and B in order, so a module's call index is the
        microbatch, as in a single-process step looping over the same microbatches."""
        if kind not in PIPELINE_PASSES:
            raise ProbeError(f"pipeline_pass: kind {kind!r} is not one of {PIPELINE_PASSES}")
        for what, value in (("stage", stage), ("microbatch", microbatch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ProbeError(f"pipeline_pass: {what} must be an int >= 0, got {value!r}")
        rec = self._recorder
        if rec is None:
            yield
            return
        outer, rec.where = rec.where, {"stage": stage, "microbatch": microbatch, "pass": kind}
        try:
            yield
        finally:
            end_pass = getattr(self._dumper, "end_pass", None)  # items the pass has not handed over yet
            if end_pass is not None:
                end_pass()
            rec.where = outer

    def jit(self, fn: Any) -> Any:
        """A fresh ``mindspore.jit`` of ``fn`` (a function, or one already wrapped by ``mindspore.jit``).

        With ``jit="graph"``, call it between ``start()`` and ``stop()``: it compiles at its first
        call, with the probes of the dumped step inside (a graph compiled before ``start()`` has
        none; MindSpore keeps each compiled graph as it was built)."""
        import mindspore as ms

        while getattr(fn, "__wrapped_by_jit__", False) and hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        if not callable(fn):
            raise ProbeError(f"jit(fn): {fn!r} is not callable")
        return ms.jit(fn)

    def close(self) -> None:
        """Remove every hook and restore wrapped APIs."""
        if self._dumper is not None:
            if self._recorder is not None and self._recorder.enabled:
                self.stop()
            self._dumper.detach()
        self._dumper = None
        self._models = None

    @property
    def current_step(self) -> int:
        return self._recorder.step if self._recorder is not None else getattr(self, "_pending_init_step", 0)

    @property
    def jit_cells(self) -> list[str]:
        """Cells whose mindspore.jit construct limits the dump to their boundary."""
        return list(self._dumper.jit_cells) if self._dumper is not None else []

    def _ensure_recorder_free(self) -> None:
        if self._recorder is not None and self._recorder.enabled:
            raise ProbeError("cannot change the step while recording; call stop() first")

    def _attach(self, model: Any) -> None:
        models = list(model) if isinstance(model, (list, tuple)) else [model]
        if not models:
            raise ProbeError("start(model): empty model list")
        frameworks = {detect_framework(m) for m in models}
        if len(frameworks) != 1:
            raise ProbeError(f"start(model): the models mix frameworks {sorted(frameworks)}")
        framework = frameworks.pop()
        step = self.current_step
        if self._dumper is not None:
            self._dumper.detach()
        named = [
            (str(i) if len(models) > 1 or isinstance(model, (list, tuple)) else "", m) for i, m in enumerate(models)
        ]
        if framework == "mindspore":
            from .adapter_mindspore import MindSporeAdapter
            from .dump_mindspore import MindSporeDumper

            adapter, dumper_cls = MindSporeAdapter(), MindSporeDumper
        else:
            from .dump_torch import TorchAdapter, TorchDumper

            adapter, dumper_cls = TorchAdapter(), TorchDumper
        if self._recorder is None or self._recorder.adapter.framework != framework:
            self._recorder = Recorder(self.config, adapter, self.rank)
            self._recorder.step = step
        self._dumper = dumper_cls(self._recorder, named)
        self._dumper.attach()
        self._models = model
