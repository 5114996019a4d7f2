"""Checkpoints: every rank's arrays plus one JSON state, written atomically with a manifest.

Layout of a checkpoint directory::

    DIR/LATEST                       name of the newest complete checkpoint (replaced atomically)
    DIR/step_000010/manifest.json    format, version, step, world size, {file: {bytes, sha256}}
    DIR/step_000010/state.json       step, config, data cursor, RNG states, history (rank 0 writes it)
    DIR/step_000010/rank_00000.safetensors   that rank's arrays (master shards, Adam state, ...)

Every rank writes its file into ``DIR/.step_000010.tmp/``; after a barrier rank 0 writes the state
and the manifest (checksums of every file), renames the directory into place and only then
replaces LATEST. A process killed at any point leaves LATEST on the previous complete checkpoint
(a stale ``.tmp`` directory is removed by the next save). Readers verify sizes and SHA-256 sums
before using anything. No pickle: safetensors for arrays, JSON for the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import CheckpointError

FORMAT = "ms-rlhf-checkpoint"
VERSION = 1


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rank_file(rank: int) -> str:
    """File name of a rank's arrays."""
    return f"rank_{rank:05d}.safetensors"


def save(
    directory: str | os.PathLike,
    step: int,
    arrays: Mapping[str, np.ndarray],
    state: dict[str, Any] | None,
    group,
    keep: int = 2,
) -> str:
    """Collective: every rank of `group` passes its arrays; rank 0 passes the JSON-able `state`.
    Returns the checkpoint's path."""
    from safetensors.numpy import save_file

    directory = os.fspath(directory)
    name = f"step_{step:06d}"
    tmp, final = os.path.join(directory, f".{name}.tmp"), os.path.join(directory, name)
    if group.rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    group.barrier()
    path = os.path.join(tmp, rank_file(int(group.ranks[group.rank])))
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, path + ".part")
    os.replace(path + ".part", path)
    group.barrier()
    if group.rank == 0:
        _write_atomic(os.path.join(tmp, "state.json"), json.dumps(state, sort_keys=True).encode())
        files = sorted(os.listdir(tmp))
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "world_size": group.size,
            "files": {f: {"bytes": os.path.getsize(os.path.join(tmp, f)), "sha256": _sha256(os.path.join(tmp, f))}
                      for f in files},
        }  # fmt: skip
        _write_atomic(os.path.join(tmp, "manifest.json"), json.dumps(manifest, indent=1).encode())
        if os.path.exists(final):  # the same step saved again: the new one replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(os.path.join(directory, "LATEST"), name.encode())
        _prune(directory, keep)
    group.barrier()
    return final


def _prune(directory: str, keep: int) -> None:
    names = sorted(n for n in os.listdir(directory) if n.startswith("step_"))
    for old in names[:-keep]:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
    for stale in (n for n in os.listdir(directory) if n.startswith(".step_") and n.endswith(".tmp")):
        shutil.rmtree(os.path.join(directory, stale), ignore_errors=True)


def latest(directory: str | os.PathLike) -> str | None:
    """The newest complete checkpoint under `directory` (from LATEST), or None."""
    pointer = os.path.join(os.fspath(directory), "LATEST")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    path = os.path.join(os.fspath(directory), name)
    if not os.path.isdir(path):
        raise CheckpointError(f"{pointer} names {name!r}, which does not exist")
    return path


def resolve(path: str | os.PathLike) -> str:
    """A checkpoint directory from either itself or a directory holding LATEST."""
    path = os.fspath(path)
    if os.path.exists(os.path.join(path, "manifest.json")):
        return path
    found = latest(path)
    if found is None:
        raise CheckpointError(f"no checkpoint at {path!r} (no manifest.json, no LATEST)")
    return found


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest, checked for format and version."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read the manifest of {path!r}: {exc}") from None
    if manifest.get("format") != FORMAT or not 1 <= int(manifest.get("version", 0)) <= VERSION:
        raise CheckpointError(f"{path!r} is not an {FORMAT} v1..{VERSION} checkpoint: {manifest.get('format')!r}")
    return manifest


def verify(path: str, files: list[str] | None = None) -> dict[str, Any]:
    """Check sizes and checksums of `files` (default: all) against the manifest; returns it."""
    manifest = read_manifest(path)
    for name in files if files is not None else list(manifest["files"]):
        entry = manifest["files"].get(name)
        full = os.path.join(path, name)
        if entry is None or not os.path.exists(full):
            raise CheckpointError(f"checkpoint {path!r} lacks {name!r}")
        if os.path.getsize(full) != entry["bytes"] or _sha256(full) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {full!r} does not match its manifest checksum (corrupted)")
    return manifest


def load(path: str | os.PathLike, rank: int, world_size: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """This rank's arrays and the shared state of a checkpoint, verified first."""
    from safetensors.numpy import load_file

    path = resolve(path)
    manifest = verify(path, [rank_file(rank), "state.json"])
    if manifest["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint {path!r} was written by {manifest['world_size']} ranks; this run has {world_size}"
        )
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    return load_file(os.path.join(path, rank_file(rank))), state
