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
interleaved layout into the stacked one; `interleave` is its inverse.

A fused QKV projection is the other case. Megatron groups its rows per query group, `[q of group 0
(heads per group x head_dim), k0, v0, q of group 1, k1, v1, ...]`, as does MindSpore Transformers'
default `SelfAttention`; its `SelfAttentionContiguous` (`use_contiguous_weight_layout_attention=True`)
stacks them, `[Q; K; V]`. `group` (with `groups` and `parts`, each part's rows per group in units of
head_dim) turns the stacked layout into the grouped one, `ungroup` is its inverse:

    layouts:
      - {path: "{p*}.self_attention.linear_qkv", side: target, rule: group, groups: 8, parts: [4, 1, 1],
         axes: {forward.output: -1, backward.input: -1, parameter: 0, param_grad: 0}}

(8 query groups of 4 heads; head_dim is what is left of the axis.) `axes` keys are a data role
(`input`, `output`, `parameter`, `param_grad`) or `direction.role` (a backward item's `input` is the
gradient of the module's output). Statistics are unchanged by a permutation, so the rules matter
in tensor mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ProbeError

RULES = ("deinterleave", "interleave", "group", "ungroup")
ROLES = ("input", "output", "parameter", "param_grad")


@dataclass(frozen=True)
class LayoutRule:
    """Rearrange a module's tensors on one side into the other side's layout."""

    path: Any
    """Path template (mapping.Template) of the modules, on `side`'s own names."""
    side: str
    """"target" or "golden": whose tensors are rearranged."""
    rule: str
    """"deinterleave", "interleave", "group" or "ungroup"."""
    parts: int | tuple[int, ...]
    """(de)interleave: how many tensors are interleaved (2 for gate/up); (un)group: each part's
    rows per group, in units ((4, 1, 1) for q, k, v of 4 query heads per group)."""
    axes: dict[str, int] = field(default_factory=dict)
    """Data role (or `direction.role`) -> the axis rearranged; roles not listed are left alone."""
    groups: int = 1
    """(un)group: the number of groups (query groups of a GQA projection)."""

    def axis(self, direction: str, role: str) -> int | None:
        return self.axes.get(f"{direction}.{role}", self.axes.get(role))

    def apply(self, array: np.ndarray, axis: int) -> np.ndarray:
        """The array in the other layout (a ProbeError when the axis does not split into `parts`)."""
        if not -array.ndim <= axis < array.ndim:
            raise ProbeError(f"layout rule {self.path.text!r}: axis {axis} outside a {array.ndim}-D tensor")
        n = array.shape[axis]
        moved = np.moveaxis(array, axis, 0)
        rest = moved.shape[1:]
        if self.rule in ("group", "ungroup"):
            return np.moveaxis(self._regroup(moved, n, axis), 0, axis)
        if n % self.parts:
            raise ProbeError(
                f"layout rule {self.path.text!r}: axis {axis} of size {n} does not split into {self.parts}"
            )
        if self.rule == "deinterleave":  # [j, k] (j-th row of part k) -> [k, j]
            out = moved.reshape(n // self.parts, self.parts, *rest).swapaxes(0, 1)
        else:
            out = moved.reshape(self.parts, n // self.parts, *rest).swapaxes(0, 1)
        return np.moveaxis(out.reshape(moved.shape), 0, axis)

    def _regroup(self, moved: np.ndarray, n: int, axis: int) -> np.ndarray:
        """Axis 0 of `moved` from stacked parts to per-group parts ("group") or back ("ungroup")."""
        per_group = self.groups * sum(self.parts)
        if n % per_group:
            raise ProbeError(
                f"layout rule {self.path.text!r}: axis {axis} of size {n} is not {self.groups} groups of "
                f"parts {list(self.parts)} (units of {n / per_group:g} rows)"
            )
        sizes = [p * (n // per_group) for p in self.parts]  # each part's rows in one group
        rest = moved.shape[1:]
        if self.rule == "group":  # [Q; K; V] -> [q0, k0, v0, q1, k1, v1, ...]
            pieces = np.split(moved, np.cumsum([self.groups * s for s in sizes])[:-1])
            grouped = [piece.reshape(self.groups, size, *rest) for piece, size in zip(pieces, sizes)]
            return np.concatenate(grouped, axis=1).reshape(moved.shape)
        grouped = moved.reshape(self.groups, sum(sizes), *rest)
        pieces = np.split(grouped, np.cumsum(sizes)[:-1], axis=1)
        return np.concatenate([piece.reshape(self.groups * size, *rest) for piece, size in zip(pieces, sizes)])

    def to_dict(self) -> dict[str, Any]:
        out = {"path": self.path.text, "side": self.side, "rule": self.rule, "axes": self.axes}
        if self.rule in ("group", "ungroup"):
            return {**out, "groups": self.groups, "parts": list(self.parts)}
        return {**out, "parts": self.parts}


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
    groups = 1
    if rule in ("group", "ungroup"):
        if not isinstance(parts, list) or len(parts) < 2 or not all(_positive(p) for p in parts):
            raise ProbeError(f"{where}: parts {parts!r} must list each part's rows per group (ints >= 1), two or more")
        groups = raw.get("groups")
        if not _positive(groups):
            raise ProbeError(f"{where}: groups {groups!r} must be an int >= 1 (the query groups)")
        parts = tuple(parts)
    elif isinstance(parts, bool) or not isinstance(parts, int) or parts < 2:
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
    return LayoutRule(template(raw["path"], where), side, rule, parts, {str(k): v for k, v in axes.items()}, groups)


def _positive(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


__all__ = ["LayoutRule", "layout_rule_from_dict"]
