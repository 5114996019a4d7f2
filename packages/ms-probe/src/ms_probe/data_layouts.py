"""Data-layout rules: a tensor rearranged into the other framework's layout before it is compared.

Two frameworks can hold the same numbers in another order. MindSpore Transformers' `linear_fc1`
(`use_interleaved_weight_layout_mlp=True`, its default) interleaves the gate and up rows,
`[g0, u0, g1, u1, ...]`, where Megatron stacks them, `[g0, g1, ...; u0, u1, ...]`; so its output,
the gradient flowing into it and its weight differ element by element from Megatron's although the
layer computes the same thing. A rule names the modules and the axis of each data role:

    layouts:
      - {path: "{p*}.mlp.linear_fc1", side: target, rule: deinterleave, parts: 2,
         axes: {forward.output: -1, backward.input: -1, parameter: 0, param_grad: 0}}

`deinterleave` (parts p) moves element j*p + k of the axis to k*(n/p) + j, which turns the
interleaved layout into the stacked one; `interleave` is its inverse. `axes` keys are a data role
(`input`, `output`, `parameter`, `param_grad`) or `direction.role` (a backward item's `input` is the
gradient of the module's output). Statistics are unchanged by a permutation, so the rules matter
in tensor mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ProbeError

RULES = ("deinterleave", "interleave")
ROLES = ("input", "output", "parameter", "param_grad")


@dataclass(frozen=True)
class LayoutRule:
    """Rearrange a module's tensors on one side into the other side's layout."""

    path: Any
    """Path template (mapping.Template) of the modules, on `side`'s own names."""
    side: str
    """"target" or "golden": whose tensors are rearranged."""
    rule: str
    """"deinterleave" or "interleave"."""
    parts: int
    """How many tensors are interleaved (2 for gate/up)."""
    axes: dict[str, int] = field(default_factory=dict)
    """Data role (or `direction.role`) -> the axis rearranged; roles not listed are left alone."""

    def axis(self, direction: str, role: str) -> int | None:
        return self.axes.get(f"{direction}.{role}", self.axes.get(role))

    def apply(self, array: np.ndarray, axis: int) -> np.ndarray:
        """The array in the other layout (a ProbeError when the axis does not split into `parts`)."""
        if not -array.ndim <= axis < array.ndim:
            raise ProbeError(f"layout rule {self.path.text!r}: axis {axis} outside a {array.ndim}-D tensor")
        n = array.shape[axis]
        if n % self.parts:
            raise ProbeError(
                f"layout rule {self.path.text!r}: axis {axis} of size {n} does not split into {self.parts}"
            )
        moved = np.moveaxis(array, axis, 0)
        rest = moved.shape[1:]
        if self.rule == "deinterleave":  # [j, k] (j-th row of part k) -> [k, j]
            out = moved.reshape(n // self.parts, self.parts, *rest).swapaxes(0, 1)
        else:
            out = moved.reshape(self.parts, n // self.parts, *rest).swapaxes(0, 1)
        return np.moveaxis(out.reshape(moved.shape), 0, axis)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path.text, "side": self.side, "rule": self.rule, "parts": self.parts, "axes": self.axes}


def layout_rule_from_dict(raw: Any, where: str, template) -> LayoutRule:
    """A LayoutRule from its YAML form; every bad field is named."""
    if not isinstance(raw, dict):
        raise ProbeError(f"{where}: expected {{path, side, rule, parts, axes}}, got {raw!r}")
    for key in ("path", "side", "rule", "parts", "axes"):
        if key not in raw:
            raise ProbeError(f"{where}: missing key {key!r}")
    side, rule, parts, axes = raw["side"], raw["rule"], raw["parts"], raw["axes"]
    if side not in ("target", "golden"):
        raise ProbeError(f"{where}: side {side!r} must be 'target' or 'golden'")
    if rule not in RULES:
        raise ProbeError(f"{where}: rule {rule!r} is not one of {list(RULES)}")
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 2:
        raise ProbeError(f"{where}: parts {parts!r} must be an int >= 2")
    if not isinstance(axes, dict) or not axes:
        raise ProbeError(f"{where}: axes {axes!r} must map data roles to axes")
    for key, axis in axes.items():
        role = str(key).rsplit(".", 1)[-1]
        direction = str(key).rsplit(".", 1)[0] if "." in str(key) else None
        if role not in ROLES or direction not in (None, "forward", "backward"):
            raise ProbeError(
                f"{where}: axes key {key!r}; expected a role {list(ROLES)}, optionally after 'forward.'/'backward.'"
            )
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise ProbeError(f"{where}: axes[{key!r}] = {axis!r} is not an int")
    return LayoutRule(template(raw["path"], where), side, rule, parts, {str(k): v for k, v in axes.items()})


__all__ = ["LayoutRule", "layout_rule_from_dict"]
