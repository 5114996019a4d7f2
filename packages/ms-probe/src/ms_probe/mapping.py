"""Name mappings between two module trees (YAML), target side to golden side.

A mapping file:

    name: mindformers-megatron-llama
    target: MindSpore Transformers training_graph          # free text
    golden: Megatron-core (local spec)
    strip: {target: [], golden: ["module.module.", "module."]}   # wrapper prefixes dropped first
    modules:                          # path templates, first match wins; other paths map to themselves
      - {target: "model.decoder.layers.{i}.self_attention.linear_qb",
         golden: "decoder.layers.{i}.self_attention.linear_q_up_proj"}
      - {target: "model.{rest*}", golden: "{rest*}"}
    skip:                             # modules with no counterpart on one side, and why
      - {side: target, path: "model.loss{rest*}", reason: "the loss Cell is MindFormers only"}
    data:                             # data-key renames inside matching modules
      - {path: "{p*}.self_attn", target: "input.0", golden: "input.hidden_states"}
    api: {Functional.matmul: Torch.matmul}
    layouts:                          # data-layout rules applied before compare (data_layouts.py)
      - {path: "{p*}.mlp.linear_fc1", side: target, rule: deinterleave, parts: 2,
         axes: {forward.output: -1, backward.input: -1, parameter: 0, param_grad: 0}}

`{x}` matches one path segment, `{x*}` any dotted rest (possibly empty); templates work in both
directions, so `mapping.reversed()` maps golden to target. Class names are not part of a path:
items align by path, direction and call index, so `Linear` and `ColumnParallelLinear` still meet.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml

from ms_layout.files import FileError, read_capped
from ms_layout.limits import Limit

from .data_layouts import LayoutRule, layout_rule_from_dict
from .errors import ProbeError
from .joins import JoinRule, apply_joins, join_rule_from_dict

MAX_MAPPING_BYTES = Limit("MS_PROBE_MAX_MAPPING_BYTES", 16 << 20, "bytes")
"""Largest mapping YAML file read."""

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(\*?)\}")


@dataclass(frozen=True)
class Template:
    """A dotted path with `{x}` (one segment) and `{x*}` (any rest) placeholders."""

    text: str

    def regex(self) -> re.Pattern:
        parts, pos = [], 0
        for m in _PLACEHOLDER.finditer(self.text):
            parts.append(re.escape(self.text[pos : m.start()]))
            parts.append(f"(?P<{m[1]}>.*)" if m[2] else f"(?P<{m[1]}>[^.]+)")
            pos = m.end()
        parts.append(re.escape(self.text[pos:]))
        return re.compile("^" + "".join(parts) + "$")

    def match(self, path: str) -> dict[str, str] | None:
        m = self.regex().match(path)
        return m.groupdict() if m else None

    def fill(self, values: dict[str, str]) -> str:
        def sub(m: re.Match) -> str:
            if m[1] not in values:
                raise ProbeError(f"template {self.text!r} uses {{{m[1]}}}, which its other side does not define")
            return values[m[1]]

        out = _PLACEHOLDER.sub(sub, self.text)
        return re.sub(r"\.\.+", ".", out).strip(".")


@dataclass
class Rule:
    target: Template
    golden: Template


@dataclass
class SkipRule:
    side: str
    path: Template
    reason: str


@dataclass
class DataRule:
    path: Template
    target: str
    golden: str


@dataclass
class NameMapping:
    """Target-to-golden module paths, skips, data-key renames and API renames."""

    name: str = "identity"
    description: str = ""
    rules: list[Rule] = field(default_factory=list)
    skips: list[SkipRule] = field(default_factory=list)
    data: list[DataRule] = field(default_factory=list)
    api: dict[str, str] = field(default_factory=dict)
    strip_target: list[str] = field(default_factory=list)
    strip_golden: list[str] = field(default_factory=list)
    layouts: list[LayoutRule] = field(default_factory=list)
    joins: list[JoinRule] = field(default_factory=list)
    source: str = ""

    # ------------------------------------------------------------------ use
    @staticmethod
    def _strip(path: str, prefixes: list[str]) -> str:
        for p in prefixes:
            if path.startswith(p):
                return path[len(p) :]
        return path

    def golden_key(self, golden_path: str) -> str:
        """A golden-side module path, normalised (wrapper prefixes removed)."""
        return self._strip(golden_path, self.strip_golden)

    def map_path(self, target_path: str) -> str:
        """The golden path a target module path corresponds to (identity when no rule matches)."""
        path = self._strip(target_path, self.strip_target)
        for rule in self.rules:
            values = rule.target.match(path)
            if values is not None:
                return rule.golden.fill(values)
        return path

    def skip_reason(self, side: str, path: str) -> str | None:
        """Why a module on `side` ("target"/"golden") has no counterpart, or None."""
        path = self._strip(path, self.strip_target if side == "target" else self.strip_golden)
        for s in self.skips:
            if s.side == side and s.path.match(path) is not None:
                return s.reason
        return None

    def map_data_key(self, golden_path: str, key: str) -> str:
        """A target data key (`input.0`) renamed to the golden module's key (`input.hidden_states`)."""
        for d in self.data:
            if d.target == key and d.path.match(golden_path) is not None:
                return d.golden
        return key

    def in_compare_layout(self, side: str, path: str, direction: str, role: str, array):
        """`array` (a tensor of the module at `path` on `side`) in the layout the compare uses: the
        first layout rule for this module and role rearranges it, otherwise it is returned as is."""
        path = self._strip(path, self.strip_target if side == "target" else self.strip_golden)
        for rule in self.layouts:
            if rule.side == side and rule.path.match(path) is not None:
                axis = rule.axis(direction, role)
                if axis is not None:
                    return rule.apply(array, axis)
        return array

    def joined(self, dump, side: str):
        """`dump` (of `side`) with this mapping's join rules applied (joins.py)."""
        if not any(j.side == side for j in self.joins):
            return dump
        prefixes = self.strip_target if side == "target" else self.strip_golden
        return apply_joins(dump, self.joins, side, lambda path: self._strip(path, prefixes))

    def map_api(self, name: str) -> str:
        """`Functional.matmul` -> `Torch.matmul` (API names without the call index)."""
        return self.api.get(name, name)

    def reversed(self) -> NameMapping:
        """The same mapping read from the golden side."""
        return NameMapping(
            name=f"{self.name} (reversed)",
            description=self.description,
            rules=[Rule(r.golden, r.target) for r in self.rules],
            skips=[SkipRule("golden" if s.side == "target" else "target", s.path, s.reason) for s in self.skips],
            data=[DataRule(d.path, d.golden, d.target) for d in self.data],
            api={v: k for k, v in self.api.items()},
            strip_target=list(self.strip_golden),
            strip_golden=list(self.strip_target),
            layouts=[
                dataclasses.replace(r, side="golden" if r.side == "target" else "target", axes=dict(r.axes))
                for r in self.layouts
            ],
            joins=[dataclasses.replace(j, side="golden" if j.side == "target" else "target") for j in self.joins],
            source=self.source,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "strip": {"target": self.strip_target, "golden": self.strip_golden},
            "modules": [{"target": r.target.text, "golden": r.golden.text} for r in self.rules],
            "skip": [{"side": s.side, "path": s.path.text, "reason": s.reason} for s in self.skips],
            "data": [{"path": d.path.text, "target": d.target, "golden": d.golden} for d in self.data],
            "api": dict(self.api),
            "layouts": [r.to_dict() for r in self.layouts],
            "joins": [j.to_dict() for j in self.joins],
        }


# ---------------------------------------------------------------------- loading
def _need(d: dict, key: str, where: str) -> Any:
    if key not in d:
        raise ProbeError(f"{where}: missing key {key!r}")
    return d[key]


def _list(raw: dict, key: str, where: str) -> list:
    value = raw.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ProbeError(f"{where}: {key}: expected a list, got {value!r}")
    return value


def _obj(value: Any, where: str, expected: str) -> dict:
    if not isinstance(value, dict):
        raise ProbeError(f"{where}: expected {expected}, got {value!r}")
    return value


def _strings(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ProbeError(f"{where}: expected a list of strings, got {value!r}")
    return list(value)


def _template(text: Any, where: str) -> Template:
    if not isinstance(text, str):
        raise ProbeError(f"{where}: {text!r} is not a path template string")
    t = Template(text)
    try:
        t.regex()
    except re.error as e:
        raise ProbeError(f"{where}: template {text!r} is invalid ({e})") from None
    return t


def mapping_from_dict(raw: Any, source: str = "<dict>") -> NameMapping:
    """Build and check a NameMapping from the YAML structure."""
    if not isinstance(raw, dict):
        raise ProbeError(f"mapping {source}: expected a mapping object, got {type(raw).__name__}")
    m = NameMapping(name=str(raw.get("name", os.path.basename(source))), description=str(raw.get("description", "")))
    m.source = source
    where = f"mapping {source}"
    strip = _obj(raw.get("strip") or {}, f"{where}: strip", "{target: [...], golden: [...]}")
    m.strip_target = _strings(strip.get("target"), f"{where}: strip.target")
    m.strip_golden = _strings(strip.get("golden"), f"{where}: strip.golden")
    for i, r in enumerate(_list(raw, "modules", where)):
        where = f"mapping {source}: modules[{i}]"
        _obj(r, where, "{target: ..., golden: ...}")
        rule = Rule(_template(_need(r, "target", where), where), _template(_need(r, "golden", where), where))
        names_t = {x[0] for x in _PLACEHOLDER.findall(rule.target.text)}
        names_g = {x[0] for x in _PLACEHOLDER.findall(rule.golden.text)}
        if names_t != names_g:
            raise ProbeError(f"{where}: placeholders differ between sides ({sorted(names_t)} vs {sorted(names_g)})")
        m.rules.append(rule)
    for i, s in enumerate(_list(raw, "skip", f"mapping {source}")):
        where = f"mapping {source}: skip[{i}]"
        side = _need(_obj(s, where, "{side: ..., path: ..., reason: ...}"), "side", where)
        if side not in ("target", "golden"):
            raise ProbeError(f"{where}: side {side!r} must be 'target' or 'golden'")
        m.skips.append(SkipRule(side, _template(_need(s, "path", where), where), str(s.get("reason", ""))))
    for i, d in enumerate(_list(raw, "data", f"mapping {source}")):
        where = f"mapping {source}: data[{i}]"
        _obj(d, where, "{path: ..., target: ..., golden: ...}")
        m.data.append(
            DataRule(
                _template(_need(d, "path", where), where),
                str(_need(d, "target", where)),
                str(_need(d, "golden", where)),
            )
        )
    api = raw.get("api") or {}
    if not isinstance(api, dict):
        raise ProbeError(f"mapping {source}: api must map target API names to golden ones")
    m.api = {str(k): str(v) for k, v in api.items()}
    for i, r in enumerate(_list(raw, "layouts", f"mapping {source}")):
        m.layouts.append(layout_rule_from_dict(r, f"mapping {source}: layouts[{i}]", _template))
    for i, r in enumerate(_list(raw, "joins", f"mapping {source}")):
        m.joins.append(join_rule_from_dict(r, f"mapping {source}: joins[{i}]", _template))
    return m


def shipped_mappings() -> dict[str, str]:
    """{name: description} of the mappings shipped with ms-probe."""
    out = {}
    for f in sorted(resources.files("ms_probe").joinpath("mappings").iterdir(), key=lambda p: p.name):
        if f.name.endswith(".yaml"):
            raw = yaml.safe_load(f.read_text())
            out[f.name[:-5]] = str(raw.get("description", "")).strip().splitlines()[0] if raw.get("description") else ""
    return out


def load_mapping(name_or_path: str | os.PathLike, reverse: bool = False) -> NameMapping:
    """A shipped mapping by name (see `shipped_mappings()`) or a YAML file; `reverse` reads it golden->target."""
    text = os.fspath(name_or_path)
    if os.path.exists(text):
        try:
            data = read_capped(text, MAX_MAPPING_BYTES.check(os.path.getsize(text), f"size of {text!r}", ProbeError))
            raw = yaml.safe_load(data.decode("utf-8"))
        except FileError as e:
            raise ProbeError(f"mapping {e}") from None
        except UnicodeDecodeError as e:
            raise ProbeError(f"mapping file {text!r} is not UTF-8 text (byte {e.start})") from None
        except RecursionError:
            raise ProbeError(f"mapping file {text!r} is nested too deeply") from None
        except yaml.YAMLError as e:
            raise ProbeError(f"mapping file {text!r} is not valid YAML: {' '.join(str(e).split())}") from None
        m = mapping_from_dict(raw, text)
    else:
        shipped = shipped_mappings()
        if text not in shipped:
            raise ProbeError(f"mapping {text!r} is neither a file nor a shipped mapping ({', '.join(shipped)})")
        res = resources.files("ms_probe").joinpath("mappings", f"{text}.yaml")
        m = mapping_from_dict(yaml.safe_load(res.read_text()), f"{text} (shipped)")
    return m.reversed() if reverse else m
