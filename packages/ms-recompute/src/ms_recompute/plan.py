"""A recompute plan: per layer, what to recompute; which layers pair up; what the planner predicted.

The plan is data. It prints as a table, has a one-line text form (``"0-3=full,4-7=mlp+self_attn"``),
serializes to msgpack inside ms-layout's versioned envelope (``ms_layout.dumps(plan)``), and is applied
to a model by one call (``ms_recompute.runtime.apply_plan``).

Granularity follows Megatron's ``recompute_granularity``: ``full`` recomputes the whole layer from its
input; ``selective`` recomputes named sub-modules (HF names inside the layer, e.g. ``mlp``,
``self_attn``) and keeps everything else; ``none`` keeps all activations.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ms_layout import LayoutError, serialization
from ms_layout.files import FileError, atomic_write, read_capped

from .errors import RecomputeError
from .limits import MAX_COMMS, MAX_LAYERS, MAX_PLAN_BYTES
from .pairing import RecomputeGroup, pair_layers

SCHEMA = 1
"""Version of the plan's dict form; readers refuse newer ones."""


class Granularity(str, Enum):
    """How much of a layer is recomputed."""

    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class LayerPlan:
    """What one layer recomputes."""

    layer: int
    """Layer index (``model.model.layers[layer]``)."""
    granularity: Granularity = Granularity.NONE
    """none, full or selective."""
    modules: tuple[str, ...] = ()
    """Sub-modules recomputed under ``selective`` (dotted paths inside the layer); empty otherwise."""

    def __post_init__(self) -> None:
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
            raise RecomputeError(f"layer index {self.layer!r}; expected an int >= 0")
        try:
            object.__setattr__(self, "granularity", Granularity(self.granularity))
        except ValueError:
            raise RecomputeError(
                f"layer {self.layer}: granularity {self.granularity!r}; expected none, full or selective"
            ) from None
        modules = tuple(self.modules)
        object.__setattr__(self, "modules", modules)
        if self.granularity is Granularity.SELECTIVE:
            if not modules:
                raise RecomputeError(f"layer {self.layer}: selective recompute names no sub-module")
            bad = [m for m in modules if not isinstance(m, str) or not _MODULE.match(m)]
            if bad:
                raise RecomputeError(
                    f"layer {self.layer}: bad sub-module names {bad}; expected dotted names like 'mlp'"
                )
            if len(set(modules)) != len(modules):
                raise RecomputeError(f"layer {self.layer}: sub-modules {list(modules)} repeat")
            nested = [(a, b) for a in modules for b in modules if b.startswith(a + ".")]
            if nested:
                raise RecomputeError(
                    f"layer {self.layer}: {nested[0][1]!r} is inside {nested[0][0]!r}; recompute one of them"
                )
        elif modules:
            raise RecomputeError(
                f"layer {self.layer}: modules {list(modules)} given with granularity {self.granularity.value}"
            )

    @property
    def label(self) -> str:
        """``none``, ``full`` or the recomputed modules joined by ``+``."""
        return "+".join(self.modules) if self.granularity is Granularity.SELECTIVE else self.granularity.value


@dataclass(frozen=True)
class Prediction:
    """What the planner expects of a plan (per microbatch, per rank)."""

    baseline_bytes: int
    """Activation bytes kept for the backward without any recompute."""
    kept_bytes: int
    """Activation bytes kept for the backward under the plan."""
    working_bytes: int
    """Largest transient of the backward: the activations one recompute group materialises at once."""
    recompute_s: float
    """Predicted time spent recomputing."""
    budget_bytes: int | None = None
    """The budget the plan was chosen for (on ``peak_bytes``), if any."""
    method: str = "manual"
    """How the plan was found: ``exact``, ``greedy`` or ``manual``."""

    def __post_init__(self) -> None:
        # A prediction is read back from plan files: wrong types would fail later, in format().
        for name in ("baseline_bytes", "kept_bytes", "working_bytes", "budget_bytes"):
            value = getattr(self, name)
            if value is None and name == "budget_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise RecomputeError(f"prediction {name}={value!r:.50}; expected an int >= 0")
        r = self.recompute_s
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(r) or r < 0:
            raise RecomputeError(f"prediction recompute_s={r!r:.50}; expected a finite number >= 0")
        if not isinstance(self.method, str):
            raise RecomputeError(f"prediction method={self.method!r:.50}; expected a name")

    @property
    def peak_bytes(self) -> int:
        """Kept activations plus the largest recompute working set."""
        return self.kept_bytes + self.working_bytes

    @property
    def saved_bytes(self) -> int:
        """Activation bytes the plan does not keep."""
        return self.baseline_bytes - self.kept_bytes


@dataclass(frozen=True)
class RecomputePlan:
    """Per-layer recompute choices for a model of ``len(layers)`` decoder layers."""

    layers: tuple[LayerPlan, ...]
    """One entry per layer, in order."""
    overlap: bool = False
    """Pair the fully recomputed layers and overlap each one's collectives with its partner's compute."""
    comms: int = 1
    """Collectives per layer recompute whose results the recompute needs (a TP layer: 1)."""
    prediction: Prediction | None = field(default=None, compare=False)
    """The planner's expectations; None for a plan written by hand."""

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        object.__setattr__(self, "layers", layers)
        for i, lp in enumerate(layers):
            if not isinstance(lp, LayerPlan):
                raise RecomputeError(f"layers[{i}] is a {type(lp).__name__}, not a LayerPlan")
            if lp.layer != i:
                raise RecomputeError(f"layers[{i}] is for layer {lp.layer}; entries must be in layer order from 0")
        if isinstance(self.comms, bool) or not isinstance(self.comms, int) or self.comms < 0:
            raise RecomputeError(f"comms={self.comms!r:.50}; expected an int >= 0")
        MAX_COMMS.check(self.comms, "comms", RecomputeError)
        if not isinstance(self.overlap, bool):
            raise RecomputeError(f"overlap={self.overlap!r:.50}; expected True or False")

    # ------------------------------------------------------------------ builders
    @classmethod
    def uniform(
        cls, num_layers: int, granularity: Granularity | str, modules: Sequence[str] = (), **kwargs: Any
    ) -> RecomputePlan:
        """The same choice for every layer."""
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise RecomputeError(f"num_layers={num_layers!r:.50}; expected a positive int")
        MAX_LAYERS.check(num_layers, "num_layers", RecomputeError)
        return cls(tuple(LayerPlan(i, Granularity(granularity), tuple(modules)) for i in range(num_layers)), **kwargs)

    @classmethod
    def parse(cls, spec: str, num_layers: int, **kwargs: Any) -> RecomputePlan:
        """From the text form: comma-separated ``layers=what``, layers as ``3`` or ``0-3``, what as
        ``none``, ``full`` or modules joined by ``+``; unnamed layers keep everything."""
        if not isinstance(spec, str):
            raise RecomputeError(f"plan spec {spec!r:.50}; expected text like '0-3=full'")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise RecomputeError(f"num_layers={num_layers!r:.50}; expected a positive int")
        MAX_LAYERS.check(num_layers, "num_layers", RecomputeError)
        choice: dict[int, LayerPlan] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            if "=" not in item:
                raise RecomputeError(f"plan item {item[:60]!r}: expected 'layers=what', e.g. '0-3=full'")
            where, what = (x.strip() for x in item.split("=", 1))
            m = re.fullmatch(r"(\d{1,18})(?:-(\d{1,18}))?", where)
            if not m:
                raise RecomputeError(f"plan item {item[:60]!r}: layers must be 'i' or 'i-j'")
            first, last = int(m.group(1)), int(m.group(2) or m.group(1))
            if last < first or last >= num_layers:
                raise RecomputeError(f"plan item {item[:60]!r}: layers {first}-{last} outside 0-{num_layers - 1}")
            for i in range(first, last + 1):
                if i in choice:
                    raise RecomputeError(f"plan item {item!r}: layer {i} is given twice")
                if what in ("none", "full"):
                    choice[i] = LayerPlan(i, Granularity(what))
                else:
                    choice[i] = LayerPlan(i, Granularity.SELECTIVE, tuple(what.split("+")))
        return cls(tuple(choice.get(i, LayerPlan(i)) for i in range(num_layers)), **kwargs)

    # ------------------------------------------------------------------ views
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layers_with(self, granularity: Granularity | str) -> list[int]:
        g = Granularity(granularity)
        return [lp.layer for lp in self.layers if lp.granularity is g]

    @property
    def groups(self) -> tuple[RecomputeGroup, ...]:
        """The fully recomputed layers in pairs (with ``overlap``) or alone, each with its order."""
        return pair_layers(self.layers_with(Granularity.FULL), self.comms, self.overlap)

    @property
    def spec(self) -> str:
        """The text form (``parse`` reads it back): runs of equal choices, none omitted."""
        items, i = [], 0
        while i < len(self.layers):
            j = i
            while j + 1 < len(self.layers) and self.layers[j + 1].label == self.layers[i].label:
                j += 1
            if self.layers[i].granularity is not Granularity.NONE:
                items.append(f"{i if i == j else f'{i}-{j}'}={self.layers[i].label}")
            i = j + 1
        return ",".join(items)

    def format(self) -> str:
        """A human-readable table: the choice per layer, the pairs and their order, the prediction."""
        lines = [
            f"RecomputePlan: {self.num_layers} layers, overlap={'on' if self.overlap else 'off'},"
            f" comms/layer={self.comms}"
        ]
        lines.append(f"  plan  {self.spec or '(nothing recomputed)'}")
        for g in self.groups:
            lines.append(f"  {'pair ' if g.paired else 'alone'} {g}")
        p = self.prediction
        if p is not None:
            mib = 1 << 20
            budget = "none" if p.budget_bytes is None else f"{p.budget_bytes / mib:.2f} MiB"
            lines += [
                f"  kept  {p.kept_bytes / mib:.2f} MiB of {p.baseline_bytes / mib:.2f} MiB"
                f" (saves {p.saved_bytes / mib:.2f} MiB); peak {p.peak_bytes / mib:.2f} MiB"
                f" with a {p.working_bytes / mib:.2f} MiB recompute working set; budget {budget}",
                f"  time  {p.recompute_s * 1e3:.3f} ms recomputing ({p.method})",
            ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict:
        p = self.prediction
        return {
            "schema": SCHEMA,
            "spec": self.spec,
            "num_layers": self.num_layers,
            "overlap": self.overlap,
            "comms": self.comms,
            "prediction": None if p is None else {k: getattr(p, k) for k in Prediction.__dataclass_fields__},
        }

    @classmethod
    def from_dict(cls, data: dict) -> RecomputePlan:
        if not isinstance(data, dict):
            raise RecomputeError(f"a plan dict was expected, got {type(data).__name__}")
        schema = data.get("schema")
        if schema != SCHEMA or isinstance(schema, bool):
            raise RecomputeError(f"plan schema {schema!r:.50}; this ms-recompute reads schema {SCHEMA}")
        missing = [k for k in ("spec", "num_layers", "overlap", "comms", "prediction") if k not in data]
        if missing:
            raise RecomputeError(f"malformed plan dict: missing {missing}")
        pred = data["prediction"]
        if pred is not None:
            if not isinstance(pred, dict):
                raise RecomputeError(f"plan prediction {pred!r:.50}; expected an object or null")
            unknown = set(pred) - set(Prediction.__dataclass_fields__)
            needed = {"baseline_bytes", "kept_bytes", "working_bytes", "recompute_s"} - set(pred)
            if unknown or needed:
                raise RecomputeError(f"plan prediction has unknown fields {sorted(unknown)} or lacks {sorted(needed)}")
        return cls.parse(
            data["spec"],
            data["num_layers"],
            overlap=data["overlap"],
            comms=data["comms"],
            prediction=None if pred is None else Prediction(**pred),
        )

    def dumps(self) -> bytes:
        """msgpack bytes in ms-layout's versioned envelope."""
        return serialization.dumps(self)

    @classmethod
    def loads(cls, blob: bytes) -> RecomputePlan:
        """Read ``dumps`` output; anything else raises RecomputeError."""
        try:
            return serialization.loads(blob, expect="RecomputePlan")
        except LayoutError as exc:
            raise RecomputeError(f"not a recompute plan: {exc}") from None

    def save(self, path: str | os.PathLike) -> None:
        """Write the msgpack form to ``path`` atomically (``ms_layout.files``: never half a file)."""
        atomic_write(path, self.dumps())

    @classmethod
    def load(cls, path: str | os.PathLike) -> RecomputePlan:
        """Read a plan file; missing, oversized or damaged files raise RecomputeError naming it."""
        try:
            blob = read_capped(path, MAX_PLAN_BYTES.value, "plan file")
        except FileError as exc:
            raise RecomputeError(str(exc)) from None
        try:
            return cls.loads(blob)
        except RecomputeError as exc:
            raise RecomputeError(f"plan file {os.fspath(path)!r}: {exc}") from None


serialization.register("RecomputePlan", RecomputePlan, RecomputePlan.to_dict, RecomputePlan.from_dict)
