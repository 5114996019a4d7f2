"""Reads dumps back: msprobe's folders (ours or msprobe's own), tolerant of damage, wary of input.

`find_rank_dirs(path)` accepts a dump root (`step*/`), a step folder (`rank*/` or `proc*/`) or a
rank folder, and returns {(step, rank): folder}. `load_rank(folder)` returns a RankDump whose
`problems` list says what was wrong instead of failing on the first one; the part of them that means
the dump is not what its writer wrote, or cannot be checked, is also in `damage` (files that differ
from manifest.json, a truncated dump.json whose complete items are still read, records of the wrong
type, tensor files that are missing or refused). A folder that holds no usable dump.json at all
(not UTF-8, not a JSON object, nested too deeply, over MS_PROBE_MAX_JSON_BYTES) is a ProbeError.

Every file a dump names is opened through `ms_layout.files.safe_join` relative to the rank folder:
absolute names, `..`, symlinks out of the folder and non-regular files (`/dev/zero`) are refused,
and tensor files over MS_PROBE_MAX_TENSOR_BYTES are not read.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ms_layout.files import FileError, read_capped, safe_join, sha256_bytes
from ms_layout.limits import Limit

from .errors import ProbeError
from .naming import ItemName, parse_item
from .records import DataEntry, flatten_entry, salvage_data

MAX_JSON_BYTES = Limit("MS_PROBE_MAX_JSON_BYTES", 1 << 30, "bytes")
"""Largest dump.json, stack.json, construct.json or manifest.json read."""
MAX_TENSOR_BYTES = Limit("MS_PROBE_MAX_TENSOR_BYTES", 1 << 32, "bytes")
"""Largest tensor file (.npy) of a dump read."""

_STEP_RE = re.compile(r"^step(\d+)$")
_RANK_RE = re.compile(r"^(rank|proc)(\d+)$")
_JSON_FILES = ("dump.json", "stack.json", "construct.json")

__all__ = ["MAX_JSON_BYTES", "MAX_TENSOR_BYTES", "DataEntry", "DumpItem", "RankDump", "find_rank_dirs", "load_rank"]


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
    where: dict[str, Any] | None = None
    """In a pipelined step's dump: the pass the item ran in, {stage, microbatch, pass} (pipeline.json)."""


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
    """Everything worth saying about the folder, damage included."""
    damage: list[str] = field(default_factory=list)
    """What makes the dump damaged or unverifiable (also in `problems`)."""
    manifest: dict[str, Any] | None = None
    """{file: {bytes, sha256}} (or the older {size, crc32}) from manifest.json; None without one."""

    @property
    def tensor_dir(self) -> Path:
        return self.folder / "dump_tensor_data"

    def note(self, message: str) -> None:
        self.problems.append(message)

    def damaged(self, message: str) -> None:
        self.problems.append(message)
        self.damage.append(message)

    def mismatch(self, name: str, raw: bytes) -> str | None:
        """Why `raw` (the bytes of `name`) is not what manifest.json lists, or None when it is (or
        when there is no manifest: msprobe's own dumps have none)."""
        if self.manifest is None:
            return None
        entry = self.manifest.get(name)
        if entry is None:
            return "not listed in manifest.json"
        if "sha256" in entry:
            size, ok = entry["bytes"], len(raw) == entry["bytes"] and sha256_bytes(raw) == entry["sha256"]
            what = "sha256"
        else:  # manifests of ms-probe 0.1 (version 1)
            size = entry["size"]
            ok = len(raw) == size and f"{zlib.crc32(raw) & 0xFFFFFFFF:08x}" == entry["crc32"]
            what = "CRC-32"
        if ok:
            return None
        return f"{len(raw)} bytes, {what} differs from manifest.json ({size} bytes): corrupt or truncated"

    def load_tensor(self, item: DumpItem, entry: DataEntry) -> np.ndarray | None:
        """The entry's .npy array, or None (with a line in `damage`) when missing, refused or damaged."""
        file_name = entry.info.get("data_name")
        if not file_name:
            return None
        rel, where = f"dump_tensor_data/{file_name}", f"{item.name}.{entry.key}"
        try:
            if os.path.isabs(file_name) or file_name.startswith(("/", "\\")):
                where_ok = "only relative names inside it"
                raise FileError(f"tensor file name {file_name!r} leaves its folder {str(self.folder)!r}; {where_ok}")
            path = safe_join(self.folder, rel, what="tensor file", must_exist=False)
            if not path.exists():
                self.damaged(f"{rel}: missing (named by {where})")
                return None
            cap = MAX_TENSOR_BYTES.value
            MAX_TENSOR_BYTES.check(path.stat().st_size, f"size of {rel}", FileError)
            raw = read_capped(path, cap, "tensor file")
        except FileError as e:
            self.damaged(f"{rel}: refused: {e} (named by {where})")
            return None
        why = self.mismatch(rel, raw)
        if why:
            self.damaged(f"{rel}: {why}")
            return None
        array, why = _load_npy(raw)
        if array is None:
            self.damaged(f"{rel}: not a usable .npy file ({why})")
        return array


def _load_npy(raw: bytes) -> tuple[np.ndarray | None, str]:
    """An array from .npy bytes, checking the header against the data before allocating anything
    (a 100-byte file may claim a shape of 10**12 elements)."""
    f = io.BytesIO(raw)
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(f)
        else:
            return None, f"format version {version} is not read"
    except Exception as e:  # numpy's header parser on arbitrary bytes raises ValueError, SyntaxError, ...
        return None, f"{type(e).__name__}: {e}"
    if dtype.hasobject or dtype.kind not in "biuf":
        return None, f"dtype {dtype} is not a number type"
    need, have = math.prod(shape) * dtype.itemsize, len(raw) - f.tell()
    if need != have:
        return None, f"its header says {need} bytes of data, it holds {have}"
    array = np.frombuffer(raw, dtype=dtype, count=math.prod(shape), offset=f.tell())
    return array.reshape(shape, order="F" if fortran else "C"), ""


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
def _read(dump: RankDump, name: str) -> bytes | None:
    """The bytes of `name` in the rank folder, None when it is missing; a ProbeError for a file that
    leaves the folder, is not a regular file or is over MS_PROBE_MAX_JSON_BYTES."""
    try:
        path = safe_join(dump.folder, name, what=name, must_exist=False)
        if not path.exists():
            return None
        MAX_JSON_BYTES.check(path.stat().st_size, f"size of {name} {str(path)!r}", FileError)
        return read_capped(path, MAX_JSON_BYTES.value, name)
    except FileError as e:
        raise ProbeError(str(e)) from None


def _decode(dump: RankDump, name: str, raw: bytes) -> tuple[str | None, str]:
    """(text, "") or (None, why). A file cut inside a UTF-8 character is truncated, not foreign."""
    try:
        return raw.decode("utf-8"), ""
    except UnicodeDecodeError as e:
        if e.reason == "unexpected end of data" and e.start >= len(raw) - 3:
            dump.damaged(f"{name}: ends inside a UTF-8 character: truncated")
            return raw[: e.start].decode("utf-8"), ""
        return None, f"not UTF-8 text (byte {e.start})"


def _parse(text: str) -> tuple[Any, str]:
    """(document, "") or (None, why)."""
    try:
        return json.loads(text), ""
    except RecursionError:
        return None, "nested too deeply"
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): truncated or corrupt"


def _read_manifest(dump: RankDump) -> None:
    raw = _read(dump, "manifest.json")
    if raw is None:
        dump.note("manifest.json: none (msprobe's own dumps have none): files are not verified")
        return
    text, why = _decode(dump, "manifest.json", raw)
    doc, why = _parse(text) if text is not None else (None, why)
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict):
        why = why or "has no 'files' object"
        dump.damaged(f"manifest.json: {why}; files are not verified")
        return
    dump.manifest = {}
    for name, entry in files.items():
        good = isinstance(entry, dict) and (
            (_is_size(entry.get("bytes")) and isinstance(entry.get("sha256"), str))
            or (_is_size(entry.get("size")) and isinstance(entry.get("crc32"), str))
        )
        if good:
            dump.manifest[name] = entry
        else:
            dump.damaged(f"manifest.json: entry of {name!r} is not {{bytes, sha256}}: {entry!r}")


def _is_size(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _read_side_file(dump: RankDump, name: str, optional: bool = False) -> Any:
    """construct.json, stack.json or pipeline.json: the document, or None (with a line in
    `problems`, unless the file is `optional` and the manifest does not list it)."""
    raw = _read(dump, name)
    if raw is None:
        listed = dump.manifest is not None and name in dump.manifest
        if listed:
            dump.damaged(f"{name}: missing (manifest.json lists it)")
        elif not optional:
            dump.note(f"{name}: missing")
        return None
    why = dump.mismatch(name, raw)
    if why:
        dump.damaged(f"{name}: {why}")
    text, why = _decode(dump, name, raw)
    doc, why = _parse(text) if text is not None else (None, why)
    if why:
        dump.damaged(f"{name}: {why}")
    if doc is not None and not isinstance(doc, dict):
        dump.damaged(f"{name}: is a {type(doc).__name__}, expected an object")
        return None
    return doc


def _read_dump_json(dump: RankDump) -> dict[str, Any]:
    """The "data" object of dump.json (the complete items of a truncated one); sets task, level, framework."""
    path = str(dump.folder / "dump.json")
    raw = _read(dump, "dump.json")
    if raw is None:
        raise ProbeError(f"no dump.json in {str(dump.folder)!r}")
    why = dump.mismatch("dump.json", raw)
    if why:
        dump.damaged(f"dump.json: {why}")
    text, why = _decode(dump, "dump.json", raw)
    if text is None:
        raise ProbeError(f"dump.json {path!r} is {why}")
    doc, why = _parse(text)
    if why == "nested too deeply":
        raise ProbeError(f"dump.json {path!r} is nested too deeply")
    if doc is None:
        dump.damaged(f"dump.json: {why}")
        data, complete = salvage_data(text)
        dump.damaged(f"dump.json: read {len(data)} complete items" + ("" if complete else " before the damage"))
        for key in ("task", "level", "framework"):
            m = re.search(rf'"{key}"\s*:\s*"([^"]*)"', text)
            if m:
                setattr(dump, key, m[1])
        return data
    if not isinstance(doc, dict):
        raise ProbeError(f"dump.json {path!r} is a {type(doc).__name__}, expected an object with a 'data' object")
    data = doc.get("data")
    if data is None:
        raise ProbeError(f"dump.json {path!r} has no 'data' object (not a dump?)")
    if not isinstance(data, dict):
        raise ProbeError(f"dump.json {path!r}: 'data' is a {type(data).__name__}, expected an object")
    for key in ("task", "level", "framework"):
        value = doc.get(key)
        if isinstance(value, str):
            setattr(dump, key, value)
        elif value is not None:
            dump.damaged(f"dump.json: {key} {value!r} is not a string; {getattr(dump, key)!r} assumed")
    return data


def load_rank(folder: str | Path, step: int | None = None, rank: int | None = None) -> RankDump:
    """Read one rank folder; damage is reported in `problems` and `damage`, whatever is intact is kept."""
    folder = Path(folder)
    if step is None:
        m = _STEP_RE.match(folder.parent.name)
        step = int(m[1]) if m else None
    dump = RankDump(folder, step, rank if rank is not None else _rank_of(folder.name))
    _read_manifest(dump)
    data = _read_dump_json(dump)
    construct = _read_side_file(dump, "construct.json") or {}
    stack_of = _stack_index(_read_side_file(dump, "stack.json"))
    where_of = _read_side_file(dump, "pipeline.json", optional=True) or {}
    for order, (name, entry) in enumerate(data.items()):
        parsed = parse_item(name)
        if parsed is None:
            dump.note(f"dump.json: item {name[:200]!r} does not follow msprobe's naming; skipped")
            continue
        if not isinstance(entry, dict):
            dump.damaged(f"dump.json: item {name!r} is a {type(entry).__name__}, expected an object; skipped")
            continue
        damage: list[str] = []
        entries = flatten_entry(parsed, entry, name, damage)
        for d in damage:
            dump.damaged(f"dump.json: {d}")
        parent = construct.get(name)
        if parent is not None and not isinstance(parent, str):
            dump.damaged(f"construct.json: parent of {name!r} is {parent!r}, not an item name")
            parent = None
        where = where_of.get(name)
        if where is not None and not _is_where(where):
            dump.damaged(f"pipeline.json: {name!r} maps to {where!r}, not {{stage, microbatch, pass}}")
            where = None
        dump.items[name] = DumpItem(name, parsed, order, entries, parent, stack_of.get(name), where)
    return dump


def _is_where(where: Any) -> bool:
    """A pipeline.json value: {"stage": int >= 0, "microbatch": int >= 0, "pass": str}."""
    if not isinstance(where, dict) or not isinstance(where.get("pass"), str):
        return False
    return all(isinstance(where.get(k), int) and not isinstance(where.get(k), bool) and where[k] >= 0
               for k in ("stage", "microbatch"))  # fmt: skip


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
