"""Checkpoints: every rank's arrays plus one JSON state, written atomically with a manifest.

Layout of a checkpoint directory::

    DIR/LATEST                       name of the newest complete checkpoint (replaced atomically)
    DIR/step_000010/manifest.json    format, version, step, world size, {file: {bytes, sha256}}
    DIR/step_000010/state.json       step, config, data cursor, RNG states, history (rank 0 writes it)
    DIR/step_000010/rank_00000.safetensors   that rank's arrays (master shards, Adam state, ...)

Writing (collective): rank 0 makes a temporary folder ``DIR/.step_000010.tmp-PID-XXXX`` with
ms_layout.files.atomic_dir and broadcasts its name; every rank writes its file into it; after a
barrier rank 0 writes the state and the manifest, swaps the folder into place and only then
replaces LATEST. Saving a step that already exists (a finished run resumed) swaps the two folders
in one step (renameat2 exchange, or a parked copy that ``recover_dir`` puts back): the good copy
is never removed before the new one is in place. A process killed at any point leaves LATEST and
its folder intact; its temporary folder is removed by the next save or resume.

Reading: LATEST must name a ``step_NNNNNN`` folder directly inside DIR; every file is checked
against the manifest (sizes and SHA-256, through ms_layout.files.safe_join) before it is read.
:func:`newest_valid` resumes from LATEST's checkpoint or, when it does not verify, from the
newest one that does, and reports what it skipped and why. No pickle: safetensors for arrays,
JSON for the rest.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np

from ms_layout.files import (
    FileError,
    atomic_dir,
    atomic_write,
    atomic_write_json,
    clean_stale,
    read_capped,
    read_json,
    safe_join,
    sha256_bytes,
    verify_entry,
    write_manifest,
)

from .errors import CheckpointError
from .limits import MAX_STATE_BYTES

FORMAT = "ms-rlhf-checkpoint"
VERSION = 1
STEP_NAME = re.compile(r"step_(\d{6,})")
"""Checkpoint folder names: ``step_`` and the step, at least 6 digits."""
_LEGACY_TMP = re.compile(r"\.step_\d{6,}\.tmp")  # ms-rlhf 0.1's temporary folders
_NAME_WIDTH = 256  # code points of the temporary folder name rank 0 broadcasts

log = logging.getLogger("ms_rlhf")


def rank_file(rank: int) -> str:
    """File name of a rank's arrays."""
    return f"rank_{rank:05d}.safetensors"


def step_name(step: int) -> str:
    """Folder name of a step's checkpoint."""
    return f"step_{step:06d}"


# -------------------------------------------------------------------------------------------- write
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

    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise CheckpointError(f"checkpoint step {step!r}: expected an int >= 0")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise CheckpointError(f"keep={keep!r}: expected a positive int")
    directory = os.fspath(directory)
    name = step_name(int(step))
    final = os.path.join(directory, name)
    mine = rank_file(int(group.ranks[group.rank]))
    tensors = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    if group.rank != 0:
        tmp = os.path.join(directory, _share_name(group, None))
        save_file(tensors, os.path.join(tmp, mine))
        group.barrier()  # every rank's file is in the temporary folder
        group.barrier()  # rank 0 has swapped it in and replaced LATEST
        return final
    os.makedirs(directory, exist_ok=True)
    cleanup(directory)
    with atomic_dir(final, overwrite=True) as tmp:  # swapped in on success, removed on error
        _share_name(group, tmp.name)
        save_file(tensors, os.fspath(tmp / mine))
        group.barrier()
        atomic_write_json(tmp / "state.json", state, sort_keys=True)
        extra = {"format": FORMAT, "version": VERSION, "step": int(step), "world_size": group.size}
        write_manifest(tmp, os.listdir(tmp), extra)
    atomic_write(os.path.join(directory, "LATEST"), name)
    _prune(directory, keep, name)
    group.barrier()
    return final


def _share_name(group, name: str | None) -> str:
    """Rank 0's temporary folder name, on every rank."""
    buf = np.zeros(_NAME_WIDTH, np.int64)
    if name is not None:
        codes = [ord(c) for c in name]
        if len(codes) >= _NAME_WIDTH:
            raise CheckpointError(f"temporary folder name {name!r} is too long to share")
        buf[: len(codes)] = codes
    if group.size > 1:
        group.broadcast(buf, src=0)
    if name is not None:
        return name
    return "".join(chr(c) for c in buf[buf > 0])


def _steps(directory: str) -> list[tuple[int, str]]:
    """(step, name) of every checkpoint folder in `directory`, newest first."""
    found = []
    for entry in os.listdir(directory):
        m = STEP_NAME.fullmatch(entry)
        if m and os.path.isdir(os.path.join(directory, entry)) and not os.path.islink(os.path.join(directory, entry)):
            found.append((int(m.group(1)), entry))
    return sorted(found, reverse=True)


def _prune(directory: str, keep: int, current: str) -> None:
    """Keep `current` and the newest others up to `keep` checkpoints."""
    others = [n for _, n in _steps(directory) if n != current]
    for old in others[keep - 1 :]:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)


def cleanup(directory: str | os.PathLike) -> list[str]:
    """Put back a checkpoint folder a killed writer had parked, and remove the temporary files and
    folders of writers that are gone. Returns the names removed."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    removed = clean_stale(directory)
    for entry in sorted(os.listdir(directory)):
        if _LEGACY_TMP.fullmatch(entry):
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
            removed.append(entry)
    return removed


# --------------------------------------------------------------------------------------------- read
def latest(directory: str | os.PathLike) -> str | None:
    """The checkpoint folder LATEST names (not yet verified), or None without a LATEST."""
    directory = os.fspath(directory)
    pointer = os.path.join(directory, "LATEST")
    if not os.path.lexists(pointer):
        return None
    try:
        raw = read_capped(safe_join(directory, "LATEST", max_bytes=64, what="LATEST pointer"), 64, "LATEST pointer")
        name = raw.decode("ascii").strip()
    except FileError as exc:
        raise CheckpointError(str(exc)) from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{pointer} holds {raw[:64]!r}, not a step_NNNNNN name") from None
    if not STEP_NAME.fullmatch(name):
        raise CheckpointError(f"{pointer} names {name!r}, not a step_NNNNNN folder inside {directory!r}")
    path = os.path.join(directory, name)
    if os.path.islink(path) or not os.path.isdir(path):
        raise CheckpointError(f"{pointer} names {name!r}, which is not a folder in {directory!r}")
    return path


def newest_valid(directory: str | os.PathLike) -> tuple[str | None, list[dict[str, str]]]:
    """The checkpoint to resume from: LATEST's if it verifies, else the newest that does.

    Returns (path or None when `directory` holds no checkpoint at all, the skipped ones as
    ``{"checkpoint": name, "reason": why}``); each skip is also logged as a warning. Runs
    :func:`cleanup` first. Raises CheckpointError when there are checkpoints but none verifies."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        if os.path.exists(directory):
            raise CheckpointError(f"checkpoint directory {directory!r} is not a folder")
        return None, []
    cleanup(directory)
    skipped: list[dict[str, str]] = []
    order: list[str] = []
    try:
        pointed = latest(directory)
        if pointed is not None:
            order.append(os.path.basename(pointed))
    except CheckpointError as exc:
        skipped.append({"checkpoint": "LATEST", "reason": str(exc)})
    order += [n for _, n in _steps(directory) if n not in order]
    for name in order:
        path = os.path.join(directory, name)
        try:
            verify(path)
        except CheckpointError as exc:
            skipped.append({"checkpoint": name, "reason": str(exc)})
            continue
        for skip in skipped:
            log.warning("checkpoint %s skipped: %s", skip["checkpoint"], skip["reason"])
        if skipped:
            log.warning("resuming from %s, the newest checkpoint that verifies", path)
        return path, skipped
    if skipped:
        reasons = "; ".join(f"{s['checkpoint']}: {s['reason']}" for s in skipped)
        raise CheckpointError(f"no checkpoint under {directory!r} verifies ({reasons})")
    return None, []


def resolve(path: str | os.PathLike) -> str:
    """A checkpoint directory from either itself or a directory holding checkpoints (the newest
    that verifies, see :func:`newest_valid`)."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    found, _ = newest_valid(path)
    if found is None:
        raise CheckpointError(f"no checkpoint at {path!r} (no manifest.json, no step_NNNNNN folder)")
    return found


def _int(value: Any, what: str, path: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 1 << 62:
        raise CheckpointError(f"checkpoint {path!r}: manifest {what} = {value!r} is not an int in {low}..2**62")
    return value


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest, checked for format, version and field types (the files are not read)."""
    path = os.fspath(path)
    try:
        manifest = read_json(safe_join(path, "manifest.json", what="checkpoint manifest"), "checkpoint manifest")
    except FileError as exc:
        raise CheckpointError(f"cannot read the manifest of {path!r}: {exc}") from None
    except (ValueError, RecursionError) as exc:  # json's own: a 5,000-digit int, 100,000 nested lists
        raise CheckpointError(f"the manifest of {path!r} is not readable JSON ({type(exc).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{path!r} is not an {FORMAT} checkpoint: format {found!r}")
    version = manifest.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= VERSION:
        raise CheckpointError(f"{path!r} has {FORMAT} version {version!r}; this reader knows 1..{VERSION}")
    step = _int(manifest.get("step"), "step", path, 0)
    world = _int(manifest.get("world_size"), "world_size", path, 1)
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"checkpoint {path!r}: manifest has no 'files' object")
    if world + 1 > len(files):  # state.json and one file per rank, checked before any range(world)
        raise CheckpointError(f"checkpoint {path!r}: manifest lists {len(files)} files for world_size {world}")
    for need in ["state.json", *(rank_file(r) for r in range(world))]:
        if need not in files:
            raise CheckpointError(f"checkpoint {path!r} lacks {need!r} in its manifest")
    folder = os.path.basename(os.path.normpath(path))
    if STEP_NAME.fullmatch(folder) and folder != step_name(step):
        raise CheckpointError(f"checkpoint {path!r} holds the manifest of step {step}")
    return manifest


def verify(
    path: str | os.PathLike, files: list[str] | None = None, manifest: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Check sizes and checksums of `files` (default: all) against the manifest (`manifest`, as
    read_manifest returned it, or read here); returns it."""
    path = os.fspath(path)
    manifest = read_manifest(path) if manifest is None else manifest
    for name in files if files is not None else list(manifest["files"]):
        if name not in manifest["files"]:
            raise CheckpointError(f"checkpoint {path!r} lacks {name!r}")
        try:
            verify_entry(path, name, manifest["files"][name])
        except FileError as exc:  # names the file and what is wrong with it
            raise CheckpointError(f"damaged checkpoint: {exc}") from None
    return manifest


def read_state(path: str | os.PathLike, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint's state.json, read once and checked against the manifest before parsing."""
    path = os.fspath(path)
    manifest = read_manifest(path) if manifest is None else manifest
    entry = manifest["files"]["state.json"]
    try:
        verify_entry(path, "state.json", entry)  # types, size and the path inside the checkpoint
        data = read_capped(os.path.join(path, "state.json"), MAX_STATE_BYTES.value, "checkpoint state.json")
    except FileError as exc:
        raise CheckpointError(f"damaged checkpoint: {exc}") from None
    if len(data) != entry["bytes"] or sha256_bytes(data) != entry["sha256"]:  # the bytes we parse
        raise CheckpointError(f"checkpoint {path!r}: state.json changed while it was read")
    try:
        state = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8, bad JSON, a 5,000-digit int
        raise CheckpointError(f"checkpoint {path!r}: state.json is not JSON ({type(exc).__name__})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path!r}: state.json holds {type(state).__name__}, expected an object")
    return state


def load(path: str | os.PathLike, rank: int, world_size: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """This rank's arrays and the shared state of a checkpoint, verified first."""
    path = resolve(path)
    manifest = verify(path, [rank_file(rank)])
    if manifest["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint {path!r} was written by {manifest['world_size']} ranks; this run has {world_size}"
        )
    state = read_state(path, manifest)
    return _read_arrays(path, rank), state


def load_arrays(path: str | os.PathLike, manifest: dict[str, Any], rank: int) -> dict[str, np.ndarray]:
    """This rank's arrays of the checkpoint at `path` (resolved) whose `manifest` the caller has read
    (read_manifest): its file verified against that manifest first, nothing read twice."""
    path = os.fspath(path)
    verify(path, [rank_file(rank)], manifest)
    return _read_arrays(path, rank)


def _read_arrays(path: str, rank: int) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        return load_file(os.path.join(path, rank_file(rank)))
    except Exception as exc:  # safetensors raises its own SafetensorError for a malformed header
        raise CheckpointError(f"checkpoint {path!r}: {rank_file(rank)} is not a safetensors file ({exc})") from None
