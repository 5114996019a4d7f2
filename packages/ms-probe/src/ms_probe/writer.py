"""Writes one rank's dump of one step: `step{N}/rank{R}/` in msprobe's layout.

Files: dump.json (items in the order they completed: children before their parent, as msprobe
writes them), stack.json (deduplicated call stacks), construct.json (item -> parent item),
dump_tensor_data/*.npy (tensor mode) and manifest.json (size and CRC-32 of every file, ours:
readers use it to tell a truncated or corrupt file from a good one). Every file is written to a
temporary name and renamed into place, so a crash never leaves a half-written file under its name.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST_VERSION = 1


class _CrcFile:
    """A write-only file wrapper that keeps the CRC-32 and size of what went through it."""

    def __init__(self, f):
        self.f, self.crc, self.size = f, 0, 0

    def write(self, b) -> int:
        b = memoryview(b).cast("B")
        self.crc = zlib.crc32(b, self.crc)
        self.size += len(b)
        return self.f.write(b)


def atomic_write_bytes(path: Path, data: bytes) -> tuple[int, str]:
    """Write `data` to `path` through a temporary file; returns (size, crc32 hex)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return len(data), f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def atomic_write_json(path: Path, obj: Any) -> tuple[int, str]:
    """Strict JSON (no NaN literals), indented like msprobe's files."""
    return atomic_write_bytes(path, json.dumps(obj, indent=1, allow_nan=False).encode())


def atomic_save_npy(path: Path, array: np.ndarray) -> tuple[int, str]:
    """np.save through a temporary file, computing the CRC-32 while writing."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        w = _CrcFile(f)
        np.lib.format.write_array(w, np.ascontiguousarray(array), allow_pickle=False)
    os.replace(tmp, path)
    return w.size, f"{w.crc & 0xFFFFFFFF:08x}"


class DumpWriter:
    """Collects the items of one step on one rank and writes the folder."""

    def __init__(self, rank_dir: str | os.PathLike, *, task: str, level: str, framework: str):
        self.dir = Path(rank_dir)
        self.task, self.level, self.framework = task, level, framework
        self.data: dict[str, Any] = {}
        self.construct: dict[str, str | None] = {}
        self._stacks: dict[tuple[str, ...], list[str]] = {}
        self._files: dict[str, dict[str, Any]] = {}
        self.warnings: list[str] = []
        self.dir.mkdir(parents=True, exist_ok=True)
        if task == "tensor":
            self.tensor_dir.mkdir(exist_ok=True)

    @property
    def tensor_dir(self) -> Path:
        return self.dir / "dump_tensor_data"

    def save_tensor(self, data_name: str, array: np.ndarray) -> str:
        """Write `{data_name}.npy` now (as msprobe does while the model runs); returns the file name."""
        if not self.tensor_dir.exists():
            self.tensor_dir.mkdir(parents=True, exist_ok=True)
        file_name = f"{data_name}.npy"
        size, crc = atomic_save_npy(self.tensor_dir / file_name, array)
        self._files[f"dump_tensor_data/{file_name}"] = {"size": size, "crc32": crc}
        return file_name

    def add(self, name: str, entry: dict[str, Any], parent: str | None, stack: tuple[str, ...] | None) -> None:
        """Record one item; a repeated name (a hook registered twice) keeps the first."""
        if name in self.data:
            return
        self.data[name] = entry
        self.construct[name] = parent
        if stack is not None:
            self._stacks.setdefault(stack, []).append(name)

    def warn(self, message: str) -> None:
        """A problem worth a line in dump_error_info.log (as msprobe has)."""
        self.warnings.append(message)

    def flush(self) -> Path:
        """Write dump.json, stack.json, construct.json and the manifest; returns the folder."""
        dump = {
            "task": self.task,
            "level": self.level,
            "framework": self.framework,
            "dump_data_dir": str(self.tensor_dir) if self.task == "tensor" else None,
            "data": self.data,
        }
        stacks = {str(i): [names, list(frames)] for i, (frames, names) in enumerate(self._stacks.items())}
        files = dict(self._files)
        files["dump.json"] = _entry(atomic_write_json(self.dir / "dump.json", dump))
        files["stack.json"] = _entry(atomic_write_json(self.dir / "stack.json", stacks))
        files["construct.json"] = _entry(atomic_write_json(self.dir / "construct.json", self.construct))
        if self.warnings:
            text = "".join(w.rstrip("\n") + "\n" for w in self.warnings).encode()
            files["dump_error_info.log"] = _entry(atomic_write_bytes(self.dir / "dump_error_info.log", text))
        manifest = {"version": MANIFEST_VERSION, "framework": self.framework, "files": files}
        atomic_write_json(self.dir / "manifest.json", manifest)
        return self.dir


def _entry(size_crc: tuple[int, str]) -> dict[str, Any]:
    return {"size": size_crc[0], "crc32": size_crc[1]}
