"""Reads dumps back: msprobe's folders (ours or msprobe's own), tolerant of damage.

`find_rank_dirs(path)` accepts a dump root (`step*/`), a step folder (`rank*/` or `proc*/`) or a
rank folder, and returns {(step, rank): folder}. `load_rank(folder)` returns a RankDump whose
`problems` list says what was wrong (missing files, checksum mismatches from manifest.json, a
truncated dump.json whose complete items are still read) instead of failing on the first one.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ProbeError
from .naming import ItemName, parse_item

_STEP_RE = re.compile(r"^step(\d+)$")
_RANK_RE = re.compile(r"^(rank|proc)(\d+)$")


@dataclass
class DataEntry:
    """One tensor (or value) of an item: `key` is what follows the item name (`input.0`, `output.0`, ...)."""

    key: str
    role: str
    """"input", "output", "parameter" or "param_grad"."""
    info: dict[str, Any]

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.info, dict) and "shape" in self.info and "dtype" in self.info

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.info.get("shape") or ())

    @property
    def dtype(self) -> str:
        return str(self.info.get("dtype", ""))


@dataclass
class DumpItem:
    """One module call, API call or parameter-gradient record."""

    name: str
    parsed: ItemName | None
    order: int
    """Position in dump.json: the order in which items completed."""
    entries: list[DataEntry]
    parent: str | None = None
    stack: list[str] | None = None


@dataclass
class RankDump:
    """The dump of one step on one rank."""

    folder: Path
    step: int | None
    rank: int | None
    task: str = "statistics"
    level: str = "L0"
    framework: str = ""
    items: dict[str, DumpItem] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def tensor_dir(self) -> Path:
        return self.folder / "dump_tensor_data"

    def load_tensor(self, item: DumpItem, entry: DataEntry) -> np.ndarray | None:
        """The entry's .npy array, or None (with a line in `problems`) when missing or damaged."""
        file_name = entry.info.get("data_name") if isinstance(entry.info, dict) else None
        if not file_name:
            return None
        path = self.tensor_dir / file_name
        rel = f"dump_tensor_data/{file_name}"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            self.problems.append(f"{rel}: missing (named by {item.name}.{entry.key})")
            return None
        expected = self.manifest.get(rel)
        if expected and (
            len(raw) != expected.get("size") or f"{zlib.crc32(raw) & 0xFFFFFFFF:08x}" != expected.get("crc32")
        ):
            self.problems.append(
                f"{rel}: {len(raw)} bytes, CRC or size differs from manifest.json "
                f"({expected.get('size')} bytes): corrupt or truncated"
            )
            return None
        try:
            import io

            return np.load(io.BytesIO(raw), allow_pickle=False)
        except Exception as e:
            self.problems.append(f"{rel}: not a readable .npy file ({type(e).__name__}: {e})")
            return None


# ---------------------------------------------------------------------- discovery
def _has_dump(p: Path) -> bool:
    return (p / "dump.json").exists()


def _rank_of(name: str) -> int | None:
    m = _RANK_RE.match(name)
    return int(m[2]) if m else None


def find_rank_dirs(path: str | Path) -> dict[tuple[int | None, int | None], Path]:
    """{(step, rank): rank folder} under a dump root, a step folder or a rank folder."""
    p = Path(path)
    if not p.exists():
        raise ProbeError(f"dump folder {str(p)!r} does not exist")
    if not p.is_dir():
        raise ProbeError(f"{str(p)!r} is not a folder (give a dump root, a step{{N}} folder or a rank folder)")
    if _has_dump(p):
        m = _STEP_RE.match(p.parent.name)
        return {(int(m[1]) if m else None, _rank_of(p.name)): p}
    out: dict[tuple[int | None, int | None], Path] = {}
    step_m = _STEP_RE.match(p.name)
    for child in sorted(p.iterdir()):
        if child.is_dir() and _RANK_RE.match(child.name) and _has_dump(child):
            out[(int(step_m[1]) if step_m else None, _rank_of(child.name))] = child
    if out:
        return out
    for child in sorted(p.iterdir()):
        m = _STEP_RE.match(child.name)
        if child.is_dir() and m:
            for grand in sorted(child.iterdir()):
                if grand.is_dir() and _RANK_RE.match(grand.name) and _has_dump(grand):
                    out[(int(m[1]), _rank_of(grand.name))] = grand
    if not out:
        raise ProbeError(
            f"no dump.json under {str(p)!r} (expected step*/rank*/dump.json, rank*/dump.json or dump.json)"
        )
    return out


# ---------------------------------------------------------------------- parsing
def _salvage_data(text: str) -> tuple[dict[str, Any], bool]:
    """The complete items of a truncated dump.json's "data" object; True when the text was complete."""
    start = text.find('"data"')
    if start < 0:
        return {}, False
    i = text.find("{", start)
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
            if i >= n or text[i] != ":":
                break
            value, i = dec.raw_decode(text, skip(i + 1))
        except json.JSONDecodeError:
            break
        out[key] = value
        i = skip(i)
        if i < n and text[i] == ",":
            i = skip(i + 1)
    return out, False


def _is_leaf(v: Any) -> bool:
    return isinstance(v, dict) and "type" in v


def _flatten(value: Any, key: str, role: str, out: list[DataEntry]) -> None:
    if value is None:
        return
    if _is_leaf(value):
        out.append(DataEntry(key, role, value))
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{key}.{k}", role, out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _flatten(v, f"{key}.{i}", role, out)


def flatten_entry(parsed: ItemName | None, entry: Any) -> list[DataEntry]:
    """The data entries of one dump.json item, named as msprobe names its data items."""
    out: list[DataEntry] = []
    if not isinstance(entry, dict):
        return out
    if parsed is not None and parsed.kind == "param_grad":
        for pname, v in entry.items():
            if isinstance(v, list) and len(v) == 1:
                v = v[0]
            _flatten(v, pname, "param_grad", out)
        return out
    if parsed is not None and parsed.direction == "backward":
        _flatten(entry.get("input"), "input", "input", out)
        _flatten(entry.get("output"), "output", "output", out)
        return out
    for i, v in enumerate(entry.get("input_args") or []):
        _flatten(v, f"input.{i}", "input", out)
    for k, v in (entry.get("input_kwargs") or {}).items():
        _flatten(v, f"input.{k}", "input", out)
    if "input" in entry and "input_args" not in entry:  # older msprobe forward layout
        _flatten(entry.get("input"), "input", "input", out)
    _flatten(entry.get("output"), "output", "output", out)
    for pname, v in (entry.get("parameters") or {}).items():
        _flatten(v, f"parameters.{pname}", "parameter", out)
    return out


def _read_json(folder: Path, name: str, manifest: dict[str, Any], problems: list[str]) -> tuple[str | None, Any]:
    path = folder / name
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        problems.append(f"{name}: missing")
        return None, None
    expected = manifest.get(name)
    if expected and (
        len(raw) != expected.get("size") or f"{zlib.crc32(raw) & 0xFFFFFFFF:08x}" != expected.get("crc32")
    ):
        problems.append(
            f"{name}: {len(raw)} bytes, differs from manifest.json ({expected.get('size')} bytes): corrupt or truncated"
        )
    text = raw.decode("utf-8", errors="replace")
    try:
        return text, json.loads(text)
    except json.JSONDecodeError as e:
        problems.append(f"{name}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): truncated or corrupt")
        return text, None


def load_rank(folder: str | Path, step: int | None = None, rank: int | None = None) -> RankDump:
    """Read one rank folder; damage is reported in `problems`, and whatever is intact is kept."""
    folder = Path(folder)
    if step is None:
        m = _STEP_RE.match(folder.parent.name)
        step = int(m[1]) if m else None
    dump = RankDump(folder, step, rank if rank is not None else _rank_of(folder.name))
    manifest_raw = None
    if (folder / "manifest.json").exists():
        try:
            manifest_raw = json.loads((folder / "manifest.json").read_text())
            dump.manifest = manifest_raw.get("files", {})
        except (json.JSONDecodeError, AttributeError):
            dump.problems.append("manifest.json: not valid JSON; files are read without checksums")
    text, doc = _read_json(folder, "dump.json", dump.manifest, dump.problems)
    if doc is None and text is None:
        return dump
    if isinstance(doc, dict):
        data = doc.get("data") or {}
        dump.task = doc.get("task", "statistics")
        dump.level = doc.get("level", "L0")
        dump.framework = doc.get("framework", "")
    else:
        data, complete = _salvage_data(text or "")
        dump.problems.append(f"dump.json: read {len(data)} complete items" + ("" if complete else " before the damage"))
        for key in ("task", "level", "framework"):
            m = re.search(rf'"{key}"\s*:\s*"([^"]*)"', text or "")
            if m:
                setattr(dump, key, m[1])
    _, construct = _read_json(folder, "construct.json", dump.manifest, dump.problems)
    _, stacks = _read_json(folder, "stack.json", dump.manifest, dump.problems)
    stack_of = _stack_index(stacks)
    construct = construct if isinstance(construct, dict) else {}
    for order, (name, entry) in enumerate(data.items()):
        parsed = parse_item(name)
        if parsed is None:
            dump.problems.append(f"dump.json: item {name!r} does not follow msprobe's naming; skipped")
            continue
        dump.items[name] = DumpItem(
            name, parsed, order, flatten_entry(parsed, entry), construct.get(name), stack_of.get(name)
        )
    return dump


def _stack_index(stacks: Any) -> dict[str, list[str]]:
    """stack.json (26.x form {"0": [[names], [frames]]} or older {name: [frames]}) -> {name: frames}."""
    out: dict[str, list[str]] = {}
    if not isinstance(stacks, dict):
        return out
    for key, value in stacks.items():
        if isinstance(value, list) and len(value) == 2 and isinstance(value[0], list) and isinstance(value[1], list):
            for name in value[0]:
                out[str(name)] = [str(f) for f in value[1]]
        elif isinstance(value, list):
            out[key] = [str(f) for f in value]
    return out


def load_dumps(path: str | Path) -> dict[tuple[int | None, int | None], RankDump]:
    """Every rank folder under `path`, read."""
    return {key: load_rank(folder, key[0], key[1]) for key, folder in find_rank_dirs(path).items()}
