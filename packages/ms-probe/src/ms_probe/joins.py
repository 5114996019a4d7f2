"""Join rules: several modules on one side compared as the one fused module of the other side.

MindSpore Transformers' MLA (`mla_qkv_concat=True`, its default) runs q_down and kv_down as one
`linear_qkv` whose rows are `[q_down; kv_down]`; Megatron runs `linear_q_down_proj` and
`linear_kv_down_proj`. A join rule builds, on the side with the parts, one item per call that
holds what the fused module would have recorded:

    joins:
      - {path: "decoder.layers.{i}.self_attention.linear_qkv", side: golden,
         parts: ["decoder.layers.{i}.self_attention.linear_q_down_proj",
                 "decoder.layers.{i}.self_attention.linear_kv_down_proj"],
         axes: {forward.output: -1, backward.input: -1, parameter: 0, param_grad: 0},
         sum: [backward.output]}

Roles listed in `axes` are concatenated along that axis, in the order of `parts`; roles in `sum`
are added (the gradient w.r.t. a shared input is the sum of the parts'); other roles are the first
part's (a shared input). Statistics of a concatenation follow from the parts' (max of the maxima,
the element-weighted mean, the root of the summed squared norms); those of a sum do not, so in
statistics mode a summed role is left out of the joined item. The parts' items are replaced by the
joined one, which takes the first part's class, call index, parent and place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ProbeError
from .naming import ItemName
from .reader import DataEntry, DumpItem, RankDump
from .stats import array_stats, json_float, to_json_float

ROLES = ("input", "output", "parameter", "param_grad")


@dataclass(frozen=True)
class JoinRule:
    """Modules of one side joined into one item, compared with the other side's fused module."""

    path: Any
    """Template of the joined item's module path (on `side`'s own names)."""
    side: str
    """"target" or "golden": whose modules are joined."""
    parts: tuple[Any, ...]
    """Templates of the joined modules, in the fused module's order; same variables as `path`."""
    axes: dict[str, int] = field(default_factory=dict)
    """Role (or `direction.role`) -> axis along which the parts' tensors are concatenated."""
    sum: tuple[str, ...] = ()
    """Roles (or `direction.role`) whose tensors are added."""

    def how(self, direction: str, role: str) -> tuple[str, int | None]:
        """("concat", axis), ("sum", None) or ("first", None) for one data role."""
        for key in (f"{direction}.{role}", role):
            if key in self.axes:
                return "concat", self.axes[key]
            if key in self.sum:
                return "sum", None
        return "first", None

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path.text, "side": self.side, "parts": [p.text for p in self.parts],
                "axes": dict(self.axes), "sum": list(self.sum)}  # fmt: skip


def join_rule_from_dict(raw: Any, where: str, template) -> JoinRule:
    """A JoinRule from its YAML form; every bad field is named."""
    if not isinstance(raw, dict):
        raise ProbeError(f"{where}: expected {{path, side, parts, axes, sum}}, got {raw!r}")
    for key in ("path", "side", "parts"):
        if key not in raw:
            raise ProbeError(f"{where}: missing key {key!r}")
    side, parts, axes, summed = raw["side"], raw["parts"], raw.get("axes") or {}, raw.get("sum") or []
    if side not in ("target", "golden"):
        raise ProbeError(f"{where}: side {side!r} must be 'target' or 'golden'")
    if not isinstance(parts, list) or len(parts) < 2:
        raise ProbeError(f"{where}: parts {parts!r} must list two or more module paths")
    if not isinstance(axes, dict) or not isinstance(summed, list):
        raise ProbeError(f"{where}: axes {axes!r} must map roles to axes and sum {summed!r} list roles")
    for key in [*axes, *summed]:
        direction, _, role = str(key).rpartition(".")
        if role not in ROLES or direction not in ("", "forward", "backward"):
            raise ProbeError(
                f"{where}: role {key!r}; expected one of {list(ROLES)}, optionally after 'forward.'/'backward.'"
            )
    for key, axis in axes.items():
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise ProbeError(f"{where}: axes[{key!r}] = {axis!r} is not an int")
    path = template(raw["path"], where)
    return JoinRule(path, side, tuple(template(p, where) for p in parts), {str(k): v for k, v in axes.items()},
                    tuple(str(s) for s in summed))  # fmt: skip


class JoinedDump(RankDump):
    """A RankDump with joined items; their tensors are held in memory, the rest read from `source`."""

    def __init__(self, source: RankDump):
        super().__init__(source.folder, source.step, source.rank, source.task, source.level, source.framework)
        self.source = source
        self.problems, self.damage, self.manifest = source.problems, source.damage, source.manifest
        self.arrays: dict[tuple[str, str], np.ndarray] = {}

    def load_tensor(self, item: DumpItem, entry: DataEntry) -> np.ndarray | None:
        if (item.name, entry.key) in self.arrays:
            return self.arrays[(item.name, entry.key)]
        return self.source.load_tensor(item, entry)


def _concat_stats(infos: list[dict[str, Any]], axis: int) -> dict[str, Any]:
    """The record of the parts' tensors concatenated along `axis`, from their records."""
    shapes = [list(i.get("shape") or []) for i in infos]
    shape = list(shapes[0])
    if shape:
        shape[axis] = sum(s[axis] for s in shapes)
    sizes = [math.prod(s) for s in shapes]
    values = {k: [json_float(i.get(k)) for i in infos] for k in ("Max", "Min", "Mean", "Norm")}
    out = {k: v for k, v in infos[0].items() if k not in ("Max", "Min", "Mean", "Norm", "data_name", "md5")}
    out["shape"] = shape
    if any(v is None for vs in values.values() for v in vs):
        return {**out, "Max": None, "Min": None, "Mean": None, "Norm": None}
    out["Max"], out["Min"] = to_json_float(max(values["Max"])), to_json_float(min(values["Min"]))
    out["Mean"] = to_json_float(sum(m * n for m, n in zip(values["Mean"], sizes)) / max(sum(sizes), 1))
    out["Norm"] = to_json_float(math.sqrt(sum(n * n for n in values["Norm"])))
    for key in ("NanCount", "InfCount"):
        out[key] = sum(int(i.get(key) or 0) for i in infos)
    return out


def _joined_entries(dump: JoinedDump, rule: JoinRule, name: str, items: list[DumpItem], tensors: bool) -> list:
    direction = items[0].parsed.direction
    by_key = [{e.key: e for e in item.entries} for item in items]
    out = []
    for entry in items[0].entries:
        how, axis = rule.how(direction, entry.role)
        parts = [keys.get(entry.key) for keys in by_key]
        if how == "first" or any(p is None or not p.is_tensor for p in parts):
            out.append(entry)
            continue
        if tensors:
            arrays = [dump.source.load_tensor(item, p) for item, p in zip(items, parts)]
            if any(a is None for a in arrays):
                continue  # damaged: named in the dump's damage by load_tensor
            try:
                joined = np.concatenate(arrays, axis=axis) if how == "concat" else np.sum(arrays, axis=0)
            except ValueError as e:
                raise ProbeError(f"join {rule.path.text!r}: {name}.{entry.key}: parts do not join ({e})") from None
            dump.arrays[(name, entry.key)] = joined
            info = {
                **entry.info,
                "shape": list(joined.shape),
                **array_stats(joined),
                "data_name": f"{name}.{entry.key}",
            }
            out.append(DataEntry(entry.key, entry.role, info))
        elif how == "concat":
            out.append(DataEntry(entry.key, entry.role, _concat_stats([p.info for p in parts], axis)))
        # a sum's statistics cannot be had from the parts': left out in statistics mode
    return out


def apply_joins(dump: RankDump, rules: list[JoinRule], side: str, strip) -> RankDump:
    """`dump` with each rule's parts (on `side`) replaced by joined items; `dump` itself when no
    rule applies. `strip(path)`: the path without wrapper prefixes (the mapping's)."""
    rules = [r for r in rules if r.side == side]
    groups: dict[tuple, list[DumpItem | None]] = {}
    for item in dump.items.values():
        p = item.parsed
        if p is None or p.kind == "api":
            continue
        path = strip(p.path)
        for rule in rules:
            for k, part in enumerate(rule.parts):
                values = part.match(path)
                if values is not None:
                    prefix = p.path[: len(p.path) - len(path)]
                    key = (id(rule), prefix + rule.path.fill(values), p.kind, p.direction, p.index)
                    groups.setdefault(key, [None] * len(rule.parts))[k] = item
    complete = {key: items for key, items in groups.items() if all(items)}
    if not complete:
        return dump
    joined = JoinedDump(dump)
    rule_of = {id(r): r for r in rules}
    replaced: dict[str, DumpItem | None] = {}
    renamed: dict[str, str] = {}
    for (rule_id, path, kind, direction, index), items in complete.items():
        first = items[0].parsed
        parsed = ItemName(kind, first.prefix, path, first.cls, direction, index)
        name = parsed.text
        entries = _joined_entries(joined, rule_of[rule_id], name, items, dump.task == "tensor")
        replaced[items[0].name] = DumpItem(name, parsed, items[0].order, entries, items[0].parent, items[0].stack,
                                           items[0].where)  # fmt: skip
        renamed.update({item.name: name for item in items})
        for other in items[1:]:
            replaced[other.name] = None
    for item in sorted(dump.items.values(), key=lambda i: i.order):
        new = replaced.get(item.name, item)
        if new is not None:  # a parent that was a part is now the joined item
            parent = renamed.get(new.parent, new.parent) if new.parent else new.parent
            joined.items[new.name] = DumpItem(
                new.name, new.parsed, new.order, new.entries, parent, new.stack, new.where
            )
    return joined


__all__ = ["JoinRule", "JoinedDump", "apply_joins", "join_rule_from_dict"]
