"""How close two float32 runs of the same training step must be: a bound from float32 rounding.

The probe stage compares the pipelined step with a single-process reference of it. The two did
the same arithmetic in another order: the pipeline sums each weight
gradient per microbatch and then over microbatches, the reference over the whole batch at once;
the kernels may split their reductions differently on another CPU or thread count. Such
reordering changes a float32 result by at most about n * u relative to the magnitudes summed,
where u = 2**-24 is float32's unit roundoff and n the number of roundings along the value's
longest chain of accumulations (the first-order worst-case bound of Higham's gamma_n; typical
errors are nearer sqrt(n) * u). So the test is relative to each tensor's own scale:

    max |target - golden|  <=  rtol * max(max |golden|, max |target|),   rtol = n * u

and n is counted from the step (see :func:`float32_rtol`). A real bug moves values by far more
than rounding: a weight off by 1 % of its scale, a microbatch's gradient lost (Adam's first update
is lr * sign(g), so a flipped sign moves a weight by 2 lr), each fails this test by orders of
magnitude. The demo's integration test injects both and checks the failure names the module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

UNIT_ROUNDOFF = 2.0**-24
"""float32's unit roundoff u: the largest relative error of one rounding."""


@dataclass(frozen=True)
class Rtol:
    """A relative tolerance and how it was counted."""

    value: float
    """rtol = n * u."""
    roundings: int
    """n: roundings along the longest accumulation chain of the compared step."""
    derivation: str
    """How n was counted, for the check's text."""


def float32_rtol(*, layers: int, widest: int, tokens: int = 0, passes: int = 2, directions: int = 2) -> Rtol:
    """rtol for comparing two evaluation orders of the same float32 computation.

    Each value comes from `passes` runs (for a training step compared on the step after it:
    the step that was reordered, and the compared step that runs on its weights) of
    `directions` sweeps (forward and backward) through `layers` blocks whose reductions are at
    most `widest` long (hidden, intermediate, vocabulary or sequence size); a weight-gradient
    element also sums `tokens` products, one per token of the step. So
    n = tokens + passes * directions * layers * widest. (Through an optimizer step the bound does
    not carry over: Adam's first update lr * g / (|g| + eps) moves by up to ~lr / 4 when a
    gradient element within ~eps of zero changes by a rounding; compare the update separately.)"""
    for name, v in (("layers", layers), ("widest", widest), ("passes", passes), ("directions", directions)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
    n = tokens + passes * directions * layers * widest
    parts = [f"{tokens} tokens"] if tokens else []
    parts.append(f"{passes} passes x {directions} directions x {layers} blocks x width {widest}")
    return Rtol(n * UNIT_ROUNDOFF, n, f"n * u = {n} * 2^-24 (n = {' + '.join(parts)})")


@dataclass(frozen=True)
class Closeness:
    """One compared tensor's error relative to its scale."""

    item: str
    """The dumped item (module call) it belongs to."""
    key: str
    """Which of its tensors (input.0, output.0, parameters.weight, ...)."""
    max_abs_err: float
    """max |target - golden|."""
    scale: float
    """max(max |golden|, max |target|)."""

    @property
    def relative(self) -> float:
        """max_abs_err / scale (0 when both are all zero; inf when only one is)."""
        if self.scale > 0:
            return self.max_abs_err / self.scale
        return 0.0 if self.max_abs_err == 0 else math.inf

    def module(self) -> str:
        """The module path of the item: `Cell.model.layers.2.self_attn.o_proj.Linear.forward.0`
        -> `model.layers.2.self_attn.o_proj`."""
        parts = self.item.split(".")
        if parts and parts[0] in ("Cell", "Module"):
            parts = parts[1:]
        for i, p in enumerate(parts):  # the class name follows the path; it starts upper case
            if p[:1].isupper():
                return ".".join(parts[:i])
        return ".".join(parts)


def _magnitude(info: dict[str, Any] | None) -> float | None:
    if not isinstance(info, dict):
        return None
    values = [info.get("Max"), info.get("Min")]
    values = [abs(float(v)) for v in values if isinstance(v, (int, float))]  # a mask's True counts 1
    return max(values) if values else None


def closeness(rows: list[Any]) -> list[Closeness]:
    """Per compared tensor (ms-probe rows with a numeric MaxAbsErr and both sides' statistics)."""
    out = []
    for row in rows:
        err = row.metrics.get("MaxAbsErr")
        if not isinstance(err, (int, float)) or isinstance(err, bool):
            continue
        scales = [s for s in (_magnitude(row.golden_info), _magnitude(row.target_info)) if s is not None]
        if not scales:
            continue
        out.append(Closeness(row.item, row.key, float(err), max(scales)))
    return out


def judge(values: list[Closeness], rtol: Rtol) -> tuple[bool, str, Closeness | None]:
    """(every tensor within rtol, the check's text, the worst tensor). `values` in execution
    order: the text names the first module over the tolerance, where a divergence starts."""
    if not values:
        return False, "no tensor was compared", None
    worst = max(values, key=lambda c: c.relative)
    bad = [c for c in values if not c.relative <= rtol.value]
    if worst.relative == 0:
        text = f"{len(values)} tensors compared, all identical; tolerance {rtol.value:.2e} = {rtol.derivation}"
        return True, text, worst
    text = (
        f"{len(values)} tensors compared; worst max|diff| / max|value| = {worst.relative:.2e} "
        f"({worst.max_abs_err:.2e} of {worst.scale:.3g}) in module {worst.module() or worst.item} "
        f"({worst.item} {worst.key}); tolerance {rtol.value:.2e} = {rtol.derivation}"
    )
    if bad:
        first = bad[0]  # the values are in execution order: where the divergence starts
        modules = list(dict.fromkeys(c.module() or c.item for c in bad))
        text += (
            f"; {len(bad)} tensors over it in {len(modules)} modules, the first in module "
            f"{first.module() or first.item} ({first.item} {first.key}: {first.relative:.2e})"
        )
    return not bad, text, worst
