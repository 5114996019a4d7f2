"""Apply a RecomputePlan to a model's layers with one call, and undo it.

Nothing in the model is replaced: each recomputed Cell (a whole layer, or a named sub-module of it)
gets three public hooks -- a forward pre-hook that opens a ``Checkpoint`` on its inputs, saved-tensor
hooks that turn what its ops keep into slots of that checkpoint, and a forward hook that closes it.
The cell tree, the parameter names (HF names, which checkpoints and optimizers key on) and the
parameters themselves stay as they were; ``AppliedPlan.remove()`` takes the hooks off.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms

from ..errors import RecomputeError
from ..plan import Granularity, RecomputePlan
from .checkpoint import Checkpoint, Runner, TraceEvent

_APPLIED: set[int] = set()  # ids of cells that carry our hooks (a cell takes one plan at a time)


def _layers_of(model_or_layers: Any) -> list[ms.nn.Cell]:
    inner = getattr(model_or_layers, "model", None)
    if inner is not None and hasattr(inner, "layers"):
        return list(inner.layers)  # an ms_models CausalLM
    if isinstance(model_or_layers, (list, tuple, ms.nn.CellList)):
        return list(model_or_layers)
    raise RecomputeError(
        "apply_plan needs an ms_models model (with .model.layers) or a sequence of layer Cells,"
        f" got {type(model_or_layers).__name__}"
    )


def _submodule(layer: ms.nn.Cell, path: str, index: int) -> ms.nn.Cell:
    cell = layer
    for part in path.split("."):
        cell = getattr(cell, part, None)
        if not isinstance(cell, ms.nn.Cell):
            children = sorted(name for name, _ in layer.name_cells().items())
            raise RecomputeError(f"layer {index} has no sub-module {path!r} (its sub-modules: {children})")
    return cell


class AppliedPlan:
    """A plan in force on a model: its runner (timings, memory), its trace, and ``remove()``."""

    def __init__(self, plan: RecomputePlan, runner: Runner):
        self.plan = plan
        self.runner = runner
        self._handles: list[Any] = []
        self._cells: list[ms.nn.Cell] = []
        self._latest: dict[int, Checkpoint] = {}  # layer -> its latest checkpoint (pairs link to it)

    @property
    def events(self) -> list[TraceEvent]:
        """Recorded steps (``apply_plan(..., trace=True)``)."""
        return self.runner.events

    @property
    def recompute_s(self) -> float:
        """Total time spent recomputing since the last ``reset_stats``."""
        return self.runner.recompute_s

    @property
    def peak_working_bytes(self) -> int:
        """Most recomputed bytes alive at once (unique storages) since the last ``reset_stats``."""
        return self.runner.peak_live_bytes

    def reset_stats(self) -> None:
        self.runner.reset_stats()

    def attach(self, cell: ms.nn.Cell, layer: int, name: str) -> None:
        if id(cell) in _APPLIED or getattr(cell, "_saved_tensors_pack_hook", None) is not None:
            raise RecomputeError(f"{name} already has saved-tensor hooks (is a plan applied twice?)")
        stack: list[Checkpoint] = []
        group = self.runner.groups.get(layer)
        earlier = group.layers[0] if group is not None and group.paired and group.layers[1] == layer else None

        def open_checkpoint(cell_: ms.nn.Cell, args: tuple, kwargs: dict) -> None:
            ck = Checkpoint(self.runner, cell_, args, kwargs, layer, name)
            if earlier is not None:  # the same forward ran the earlier layer of the pair just before
                ck.partner = self._latest.pop(earlier, None)
            elif group is not None and group.paired:
                self._latest[layer] = ck  # only until its partner links to it: no inputs kept past that
            stack.append(ck)

        def close_checkpoint(cell_: ms.nn.Cell, args: tuple, kwargs: dict, output: Any) -> None:
            stack.pop()

        def pack(t: Any) -> Any:
            return stack[-1].pack(t)

        def unpack(slot: Any) -> Any:
            return slot.checkpoint.unpack(slot)

        self._handles.append(cell.register_forward_pre_hook(open_checkpoint, with_kwargs=True))
        self._handles.append(cell.register_forward_hook(close_checkpoint, with_kwargs=True, always_call=True))
        cell.register_saved_tensors_hooks(pack, unpack)
        self._cells.append(cell)
        _APPLIED.add(id(cell))

    def remove(self) -> None:
        """Take every hook off; the model computes as before (activations kept)."""
        for handle in self._handles:
            handle.remove()
        for cell in self._cells:
            cell.register_saved_tensors_hooks(None, None)
            _APPLIED.discard(id(cell))
        self._handles, self._cells, self._latest = [], [], {}

    def __enter__(self) -> AppliedPlan:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def apply_plan(model_or_layers: Any, plan: RecomputePlan, *, trace: bool = False) -> AppliedPlan:
    """Make the layers of ``model_or_layers`` (an ms_models model, or a list of layer Cells) recompute
    as ``plan`` says: whole layers for ``full``, the named sub-modules for ``selective``; fully
    recomputed layers in pairs when ``plan.overlap``. Returns the ``AppliedPlan`` (``remove()`` undoes it;
    ``trace=True`` records every recompute step's start and end)."""
    if not isinstance(plan, RecomputePlan):
        raise RecomputeError(f"apply_plan needs a RecomputePlan, got {type(plan).__name__}")
    layers = _layers_of(model_or_layers)
    if len(layers) != plan.num_layers:
        raise RecomputeError(f"the plan is for {plan.num_layers} layers, the model has {len(layers)}")
    groups = {layer: g for g in plan.groups for layer in g.layers}
    applied = AppliedPlan(plan, Runner(groups, plan.comms, trace))
    targets = []
    for lp, layer in zip(plan.layers, layers):
        if lp.granularity is Granularity.FULL:
            targets.append((layer, lp.layer, f"layers.{lp.layer}"))
        elif lp.granularity is Granularity.SELECTIVE:
            targets += [(_submodule(layer, m, lp.layer), lp.layer, f"layers.{lp.layer}.{m}") for m in lp.modules]
    try:
        for cell, index, name in targets:  # all resolved first: a bad name attaches nothing
            applied.attach(cell, index, name)
    except Exception:
        applied.remove()
        raise
    return applied
