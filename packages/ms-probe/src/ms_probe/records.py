"""dump.json items as data entries, checked on the way in (pure; used by reader.py).

A dump.json comes from a tool that may have died mid-write, from msprobe, or from someone's hand:
every field the compare later relies on is checked here, once. A record with a field of the wrong
type loses that field (or, for the shape and dtype of a tensor, the whole record) and the reason is
returned as damage, so that metrics, rules and the report only ever see well-formed values.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .naming import ItemName
from .stats import json_float

MAX_NESTING = 32
"""Deepest nesting of data records inside an item (msprobe writes 2-3 levels: args, tuples, dicts)."""
MAX_DIMS = 64
"""numpy's own limit on the number of axes."""
_STATS = ("Max", "Min", "Mean", "Norm")


@dataclass
class DataEntry:
    """One tensor (or value) of an item: `key` is what follows the item name (`input.0`, `output.0`, ...)."""

    key: str
    role: str
    """"input", "output", "parameter" or "param_grad"."""
    info: dict[str, Any]

    @property
    def is_tensor(self) -> bool:
        return "shape" in self.info and "dtype" in self.info

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.info.get("shape") or ())

    @property
    def dtype(self) -> str:
        return str(self.info.get("dtype", ""))


def _is_size(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def clean_leaf(info: dict[str, Any], where: str, damage: list[str]) -> dict[str, Any] | None:
    """A copy of one tensor/value record with every field of the wrong type dropped (and said so in
    `damage`); None when a tensor's shape or dtype is unusable."""
    out = dict(info)
    if "shape" in out or "dtype" in out:
        shape, dtype = out.get("shape"), out.get("dtype")
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(_is_size(d) for d in shape)):
            damage.append(f"{where}: shape {shape!r} is not a list of at most {MAX_DIMS} sizes; record skipped")
            return None
        if not isinstance(dtype, str):
            damage.append(f"{where}: dtype {dtype!r} is not a string; record skipped")
            return None
    for key in _STATS:
        v = out.get(key)
        if v is not None and not isinstance(v, (int, float, str)):
            damage.append(f"{where}: {key} {v!r} is not a number; dropped")
            out.pop(key)
    for key in ("NanCount", "InfCount"):
        if key in out and not _is_size(out[key]):
            damage.append(f"{where}: {key} {out[key]!r} is not a count; dropped")
            out.pop(key)
    for key, kinds in (("data_name", str), ("md5", str), ("requires_grad", (bool, type(None)))):
        if key in out and not isinstance(out[key], kinds):
            what = "a file name" if key == "data_name" else ("a string" if key == "md5" else "true or false")
            damage.append(f"{where}: {key} {out[key]!r} is not {what}; dropped")
            out.pop(key)
    return out


def _flatten(value: Any, key: str, role: str, out: list[DataEntry], item: str, damage: list[str], depth=0) -> None:
    if value is None:
        return
    if depth > MAX_NESTING:
        damage.append(f"{item}.{key}: nested deeper than {MAX_NESTING} levels; skipped")
        return
    if isinstance(value, dict) and "type" in value:
        info = clean_leaf(value, f"{item}.{key}", damage)
        if info is not None:
            out.append(DataEntry(key, role, info))
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{key}.{k}", role, out, item, damage, depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _flatten(v, f"{key}.{i}", role, out, item, damage, depth + 1)


def _field(entry: dict[str, Any], key: str, kind: type, item: str, damage: list[str]) -> Any:
    value = entry.get(key)
    if value is None or isinstance(value, kind):
        return value
    damage.append(f"{item}: {key} is {type(value).__name__}, expected {'a list' if kind is list else 'an object'}")
    return None


def flatten_entry(
    parsed: ItemName | None, entry: Any, item: str = "", damage: list[str] | None = None
) -> list[DataEntry]:
    """The data entries of one dump.json item, named as msprobe names its data items; what had to be
    dropped is appended to `damage`."""
    damage = [] if damage is None else damage
    out: list[DataEntry] = []
    if not isinstance(entry, dict):
        return out
    if parsed is not None and parsed.kind == "param_grad":
        for pname, v in entry.items():
            if isinstance(v, list) and len(v) == 1:
                v = v[0]
            _flatten(v, pname, "param_grad", out, item, damage)
        return out
    if parsed is not None and parsed.direction == "backward":
        _flatten(entry.get("input"), "input", "input", out, item, damage)
        _flatten(entry.get("output"), "output", "output", out, item, damage)
        return out
    for i, v in enumerate(_field(entry, "input_args", list, item, damage) or []):
        _flatten(v, f"input.{i}", "input", out, item, damage)
    for k, v in (_field(entry, "input_kwargs", dict, item, damage) or {}).items():
        _flatten(v, f"input.{k}", "input", out, item, damage)
    if "input" in entry and "input_args" not in entry:  # older msprobe forward layout
        _flatten(entry.get("input"), "input", "input", out, item, damage)
    _flatten(entry.get("output"), "output", "output", out, item, damage)
    for pname, v in (_field(entry, "parameters", dict, item, damage) or {}).items():
        _flatten(v, f"parameters.{pname}", "parameter", out, item, damage)
    return out


def salvage_data(text: str) -> tuple[dict[str, Any], bool]:
    """The complete items of a truncated dump.json's "data" object; True when the text was complete."""
    start = text.find('"data"')
    if start < 0:
        return {}, False
    i = text.find("{", start)
    if i < 0:
        return {}, False
    dec = json.JSONDecoder()
    out: dict[str, Any] = {}
    n = len(text)

    def skip(j: int) -> int:
        while j < n and text[j] in " \t\r\n":
            j += 1
        return j

    i = skip(i + 1)
    while i < n:
        if text[i] == "}":
            return out, True
        try:
            key, i = dec.raw_decode(text, i)
            i = skip(i)
            if i >= n or text[i] != ":" or not isinstance(key, str):
                break
            value, i = dec.raw_decode(text, skip(i + 1))
        except (json.JSONDecodeError, RecursionError):
            break
        out[key] = value
        i = skip(i)
        if i < n and text[i] == ",":
            i = skip(i + 1)
    return out, False


def nonfinite(info: dict[str, Any]) -> str | None:
    """What is non-finite in one record's statistics ("3 nan, 1 inf", "Max = inf"), or None."""
    nan, inf = info.get("NanCount") or 0, info.get("InfCount") or 0
    if nan or inf:
        return ", ".join(x for x in (f"{nan} nan" if nan else "", f"{inf} inf" if inf else "") if x)
    for key in _STATS:
        v = json_float(info.get(key))
        if v is not None and not math.isfinite(v):
            return f"{key} = {info.get(key)}"
    return None
