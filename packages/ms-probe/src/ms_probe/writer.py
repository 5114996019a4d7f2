"""Writes one rank's dump of one step: `step{N}/rank{R}/` in msprobe's layout.

Files: dump.json (items in the order they completed: children before their parent, as msprobe
writes them), stack.json (deduplicated call stacks), construct.json (item -> parent item),
pipeline.json (ours, in a pipelined step's dump: item -> {stage, microbatch, pass}),
dump_tensor_data/*.npy (tensor mode) and manifest.json (size and sha256 of every file, ours:
readers use it to tell a truncated or corrupt file from a good one).

The whole rank folder is built under a temporary name beside it (`ms_layout.files.atomic_dir`:
`.rank{R}.tmp-PID-*`) while the model runs, and swapped into place by `flush()` once complete: a
dump killed at any moment leaves the previous dump of that step and rank as it was, and the next
dump removes the killed writer's temporary folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ms_layout.files import atomic_dir, file_entry

MANIFEST_VERSION = 2
"""1: {size, crc32} per file (ms-probe 0.1); 2: {bytes, sha256} (ms_layout.files manifests)."""


class DumpWriter:
    """Collects the items of one step on one rank and writes the folder."""

    def __init__(self, rank_dir: str | os.PathLike, *, task: str, level: str, framework: str):
        self.dir = Path(rank_dir)
        self.task, self.level, self.framework = task, level, framework
        self.data: dict[str, Any] = {}
        self.construct: dict[str, str | None] = {}
        self.pipeline: dict[str, dict[str, Any]] = {}  # item -> the pipeline pass it ran in (pipeline.json)
        self._stacks: dict[tuple[str, ...], list[str]] = {}
        self._tensors: list[str] = []
        self.warnings: list[str] = []
        self._pending: contextlib.ExitStack | None = None
        self._work: Path | None = None
        self._published = False

    @property
    def tensor_dir(self) -> Path:
        """Where the tensor files are once the dump is in place."""
        return self.dir / "dump_tensor_data"

    def _workdir(self) -> Path:
        """The temporary folder being built (created on first use; after a flush, a new one that
        starts with hard links to the tensors already published, for a second start()/stop())."""
        if self._work is None:
            self._pending = contextlib.ExitStack()
            self._work = self._pending.enter_context(atomic_dir(self.dir, overwrite=True))
            if self.task == "tensor":
                (self._work / "dump_tensor_data").mkdir()
            if self._published:
                for rel in self._tensors:
                    _link_or_copy(self.dir / rel, self._work / rel)
        return self._work

    def save_tensor(self, data_name: str, array: np.ndarray) -> str:
        """Write `{data_name}.npy` now (as msprobe does while the model runs); returns the file name."""
        file_name = f"{data_name}.npy"
        folder = self._workdir() / "dump_tensor_data"
        folder.mkdir(exist_ok=True)
        # A plain write: the folder is private until flush() swaps it in (and fsyncs every file).
        with open(folder / file_name, "wb") as f:
            np.lib.format.write_array(f, np.ascontiguousarray(array), allow_pickle=False)
        rel = f"dump_tensor_data/{file_name}"
        if rel not in self._tensors:
            self._tensors.append(rel)
        return file_name

    def add(
        self,
        name: str,
        entry: dict[str, Any],
        parent: str | None,
        stack: tuple[str, ...] | None,
        where: dict[str, Any] | None = None,
    ) -> None:
        """Record one item; a repeated name (a hook registered twice) keeps the first. ``where``: the
        pipeline pass the item ran in ({stage, microbatch, pass}), written to pipeline.json."""
        if name in self.data:
            return
        self.data[name] = entry
        self.construct[name] = parent
        if where is not None:
            self.pipeline[name] = dict(where)
        if stack is not None:
            self._stacks.setdefault(stack, []).append(name)

    def warn(self, message: str) -> None:
        """A problem worth a line in dump_error_info.log (as msprobe has)."""
        self.warnings.append(message)

    def flush(self) -> Path:
        """Write dump.json, stack.json, construct.json and the manifest, then swap the folder in;
        returns the folder."""
        work = self._workdir()
        try:
            dump = {
                "task": self.task,
                "level": self.level,
                "framework": self.framework,
                "dump_data_dir": str(self.tensor_dir) if self.task == "tensor" else None,
                "data": self.data,
            }
            stacks = {str(i): [names, list(frames)] for i, (frames, names) in enumerate(self._stacks.items())}
            entries = {rel: file_entry(work / rel) for rel in self._tensors}
            files = [("dump.json", dump), ("stack.json", stacks), ("construct.json", self.construct)]
            if self.pipeline:
                files.append(("pipeline.json", self.pipeline))
            for name, obj in files:
                # Strict JSON (no NaN literals); not indented, so the C encoder writes it (indented, the
                # pure-Python encoder took 15 ms of a 117 ms step for 144 modules' statistics)
                entries[name] = _write(work / name, json.dumps(obj, allow_nan=False).encode())
            if self.warnings:
                text = "".join(w.rstrip("\n") + "\n" for w in self.warnings)
                entries["dump_error_info.log"] = _write(work / "dump_error_info.log", text.encode())
            # ms_layout's manifest format (write_manifest), from the bytes just written: no reading
            # them back, and no atomic write of its own inside a folder that is swapped in whole
            manifest = {"version": MANIFEST_VERSION, "framework": self.framework}
            manifest["files"] = {n: entries[n] for n in sorted(entries)}
            _write(work / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True).encode())
        except BaseException:
            self.abort()
            raise
        pending, self._pending, self._work = self._pending, None, None
        pending.close()  # atomic_dir: fsync every file, swap the folder into place
        self._published = True
        return self.dir

    def abort(self) -> None:
        """Drop what was written since the last flush (the previous dump stays in place)."""
        if self._pending is not None:
            pending, self._pending, self._work = self._pending, None, None
            pending.__exit__(RuntimeError, RuntimeError("dump aborted"), None)


def _write(path: Path, data: bytes) -> dict[str, Any]:
    """Write `data` to `path` (in the private folder: flush() fsyncs it); its manifest entry."""
    path.write_bytes(data)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)  # the published file is never written again: sharing its inode is safe
    except OSError:
        shutil.copy2(src, dst)
