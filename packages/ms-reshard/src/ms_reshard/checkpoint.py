"""Sharded safetensors checkpoints: one file per rank plus a manifest, and offline resharding.

Format (version 1), a directory holding::

    manifest.json              what is in the checkpoint, with sizes and checksums
    rank_00000.safetensors     the local shards of rank 0, keyed by parameter name
    rank_00001.safetensors     ...

``manifest.json``::

    {"format": "ms-reshard-checkpoint", "version": 1,
     "config": {ParallelConfig fields} | null,      # how it was sharded, if a config says so
     "model": {"num_layers": 2, ...},               # free-form facts a reader needs (optional)
     "params": {name: {"shape": [..], "dtype": "float32", "layout": Layout.to_dict(),
                       "parts": [sizes], "part_dim": 0}},   # parts: fused parameters only
     "files": {"0": {"path": "rank_00000.safetensors", "bytes": 1234, "sha256": "<hex>",
                     "tensors": [names]}}}

A rank's file holds its shard of every parameter whose layout includes the rank (fused parameters
hold each part's shard side by side, see fusion.py). The manifest is checked field by field before
it is used (manifest.py), every file name it holds goes through ``ms_layout.files.safe_join`` (no
``..``, absolute names or symlinks out of the folder), and every file is checked against its size
and sha256, and its tensors' shapes and dtypes against the manifest, before anything is read from
it. A checkpoint is written by ``ms_layout.files.atomic_dir``: a temporary folder beside the target,
swapped in once complete, so a failure or a ``kill -9`` at any point leaves the target as it was,
and the next write removes what a killed writer left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ms_layout import Layout, ParallelConfig
from ms_layout import files as _files
from ms_layout.files import FileError, file_entry, safe_join, sha256_file

from .errors import ReshardError
from .local import local_slices
from .manifest import FORMAT, MANIFEST, VERSION, check_files, check_manifest, load_manifest, manifest_specs
from .model_plan import ModelPlan, ParamSpec

__all__ = [
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "atomic_dir",
    "check_manifest",
    "check_target",
    "load_checkpoint",
    "load_manifest",
    "manifest_specs",
    "read_rank",
    "reshard_checkpoint",
    "save_checkpoint",
    "sha256_file",
    "verify",
]

# sha256_file is ms_layout.files.sha256_file, kept under its old name here for callers.

# safetensors' names of the dtypes a checkpoint may hold (manifest.CHECKPOINT_DTYPES)
_ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32", "int8": "I8"}
_ST_DTYPES["uint8"] = "U8"


def _file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def check_target(target: str | os.PathLike, overwrite: bool = False) -> Path:
    """`target` as a Path if a checkpoint may be written there: absent, or a folder and `overwrite`."""
    target = Path(target)
    _files.recover_dir(target)  # a writer killed while swapping folders parked the old one aside
    if target.exists() and not target.is_dir():
        raise ReshardError(f"{os.fspath(target)!r} is a file, not a checkpoint folder; choose another target")
    if target.exists() and not overwrite:
        raise ReshardError(f"{target} already exists; pass overwrite=True (--overwrite) to replace it")
    return target


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """``ms_layout.files.atomic_dir`` with ms-reshard's errors: yields a temporary folder beside
    `target` that replaces it on success; leftovers of killed writers are removed first."""
    with _files.atomic_dir(check_target(target, overwrite), overwrite) as tmp:
        yield tmp


def save_checkpoint(
    directory: str | Path,
    specs: Mapping[str, ParamSpec],
    shards: Mapping[str, Mapping[int, np.ndarray]],
    config: ParallelConfig | None = None,
    model: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> dict:
    """Write {name: {rank: shard}} under `specs` as a checkpoint; returns the manifest."""
    from safetensors.numpy import save_file

    by_rank: dict[int, dict[str, np.ndarray]] = {}
    for name, spec in specs.items():
        if name not in shards:
            raise ReshardError(f"no shards given for parameter {name!r}")
        want = spec.layout.shard_shape(spec.shape)
        for rank in spec.layout.ranks:
            if rank not in shards[name]:
                raise ReshardError(f"parameter {name!r} has no shard for rank {rank}")
            array = np.ascontiguousarray(shards[name][rank])
            if array.shape != want:
                raise ReshardError(f"shard of {name!r} on rank {rank} has shape {array.shape}; expected {want}")
            by_rank.setdefault(rank, {})[name] = array
    with atomic_dir(Path(directory), overwrite) as tmp:
        files = {}
        for rank in sorted(by_rank):
            save_file(by_rank[rank], str(tmp / _file_name(rank)))
            files[rank] = _file_entry(tmp, rank, sorted(by_rank[rank]))
        manifest = _manifest(specs, files, config, model)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _file_entry(directory: Path, rank: int, names: list[str]) -> dict:
    path = directory / _file_name(rank)
    return {"path": path.name, **file_entry(path), "tensors": names}


def _manifest(specs, files, config, model) -> dict:
    params = {}
    for n, s in sorted(specs.items()):
        params[n] = {"shape": list(s.shape), "dtype": s.dtype, "layout": s.layout.to_dict()}
        if s.parts:
            params[n].update(parts=list(s.parts), part_dim=s.part_dim)
    return {
        "format": FORMAT,
        "version": VERSION,
        "config": None if config is None else config.to_dict(),
        "model": dict(model or {}),
        "params": params,
        "files": {str(r): e for r, e in files.items()},
    }


def verify(directory: str | Path, manifest: dict, progress: bool = False) -> None:
    """Check every file's size and sha256 against the manifest; a mismatch names the file.

    A file name that leaves the folder (``..``, absolute, a symlink out) or is not a regular file
    is refused before it is opened."""
    directory = Path(directory)
    files = check_files(manifest)
    paths = {rank: _file_path(directory, rank, entry) for rank, entry in files.items()}
    bar = _bar(sum(e["bytes"] for e in files.values()), "verify", progress)
    try:
        for rank, entry in files.items():
            path = paths[rank]
            size = path.stat().st_size
            if size != entry["bytes"]:
                raise ReshardError(f"checkpoint file {path} has {size} bytes; the manifest says {entry['bytes']}")
            if sha256_file(path, bar) != entry["sha256"]:
                raise ReshardError(f"checkpoint file {path} is corrupted: its sha256 does not match the manifest")
    finally:
        if bar is not None:
            bar.close()


def _file_path(directory: Path, rank: int, entry: dict) -> Path:
    """The path of a rank's file, through safe_join (missing, outside the folder, not a file: an error)."""
    try:
        return safe_join(directory, entry["path"], what=f"checkpoint file of rank {rank}")
    except FileError as exc:
        raise ReshardError(str(exc)) from None


def _bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False)


def load_checkpoint(directory: str | Path) -> tuple[dict[str, ParamSpec], dict[str, dict[int, np.ndarray]]]:
    """Read a whole checkpoint (verified) as specs and {name: {rank: shard}}."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    directory = Path(directory)
    manifest = load_manifest(directory)
    specs = manifest_specs(manifest)
    verify(directory, manifest)
    shards: dict[str, dict[int, np.ndarray]] = {}
    for rank, entry in check_files(manifest).items():
        path = _file_path(directory, rank, entry)
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ReshardError(f"cannot read checkpoint file {path}: {exc}") from None
        if sorted(tensors) != sorted(entry["tensors"]):
            raise ReshardError(f"checkpoint file {path} holds {sorted(tensors)[:8]}, not the tensors its entry lists")
        for name, array in tensors.items():
            want = specs[name].layout.shard_shape(specs[name].shape)
            if array.shape != want or array.dtype != np.dtype(specs[name].dtype):
                raise ReshardError(
                    f"checkpoint file {path} holds {name!r} as {array.dtype}{list(array.shape)}; "
                    f"the manifest says {specs[name].dtype}{list(want)}"
                )
            shards.setdefault(name, {})[rank] = array
    return specs, shards


def reshard_checkpoint(
    src_dir: str | Path,
    dst_dir: str | Path,
    plan: ModelPlan,
    manifest: dict,
    config: ParallelConfig | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Write the checkpoint `plan` makes of the (already verified) checkpoint in `src_dir`.

    Target ranks are written one at a time, each piece read straight from the source file that
    the plan names (safetensors reads slices lazily), so memory holds one target rank's shards."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    src_dir = Path(src_dir)
    files = {r: _file_path(src_dir, r, e) for r, e in check_files(manifest).items()}
    by_rank = _pieces_by_rank(plan)
    bar = _bar(len(by_rank), "write ranks", progress)
    with contextlib.ExitStack() as stack, atomic_dir(Path(dst_dir), overwrite) as tmp:
        readers: dict[int, Any] = {}
        written = {}
        for rank in sorted(by_rank):
            tensors = _assemble(plan, rank, by_rank[rank], files, readers, stack, safe_open)
            save_file(tensors, str(tmp / _file_name(rank)))
            written[rank] = _file_entry(tmp, rank, sorted(tensors))
            if bar is not None:
                bar.update(1)
        out = _manifest(plan.dst, written, config, manifest.get("model"))
        (tmp / MANIFEST).write_text(json.dumps(out, indent=1))
    if bar is not None:
        bar.close()
    return out


def read_rank(plan: ModelPlan, rank: int, files: Mapping[int, str | os.PathLike]) -> dict[str, np.ndarray]:
    """Target rank `rank`'s shards under `plan`, each piece read straight from the safetensors file
    of the source rank the plan names (``files``: {source rank: path}, checked by the caller).

    safetensors reads slices lazily, so a rank reads only the bytes it holds afterwards: this is
    how a job resumes on another number of ranks from the files its previous run wrote."""
    from safetensors import safe_open

    pieces = _pieces_by_rank(plan).get(rank, [])
    paths = {int(r): Path(f) for r, f in files.items()}
    with contextlib.ExitStack() as stack:
        return _assemble(plan, rank, pieces, paths, {}, stack, safe_open)


def _pieces_by_rank(plan: ModelPlan) -> dict[int, list]:
    """{target rank: [(move, [(source rank, global box), ...]), ...]} over the plan's moves."""
    by_rank: dict[int, list] = {}
    for move in plan.moves:
        for rank, pieces in move.plan.sources_by_rank().items():
            by_rank.setdefault(rank, []).append((move, pieces))
    return by_rank


def _assemble(plan: ModelPlan, rank: int, moves, files, readers, stack, safe_open) -> dict[str, np.ndarray]:
    """One target rank's shards, each piece read from the source rank the plan chose."""
    out: dict[str, np.ndarray] = {}
    for move, pieces in moves:
        spec = plan.dst[move.dst_name]
        if move.dst_name not in out:
            out[move.dst_name] = np.empty(spec.layout.shard_shape(spec.shape), dtype=_dtype(spec.dtype))
        p, target = move.plan, out[move.dst_name]
        dst_at = _shifted(p.dst, p.shape, rank, move.dim, move.dst_offset)
        for src_rank, box in pieces:
            if src_rank not in readers:
                if src_rank not in files:
                    raise ReshardError(f"the plan reads rank {src_rank}, which has no file in the source checkpoint")
                try:
                    readers[src_rank] = stack.enter_context(safe_open(str(files[src_rank]), framework="numpy"))
                except Exception as exc:  # safetensors raises its own error types for a bad header
                    raise ReshardError(f"cannot read rank {src_rank}'s file {files[src_rank]}: {exc}") from None
            src_at = _shifted(p.src, p.shape, src_rank, move.dim, move.src_offset)
            try:
                sliced = readers[src_rank].get_slice(move.src_name)
                found = (sliced.get_dtype(), list(sliced.get_shape()))
            except Exception as exc:  # safetensors raises its own error types for missing names
                raise ReshardError(f"cannot read {move.src_name!r} from rank {src_rank}'s file: {exc}") from None
            _check_stored(plan.src[move.src_name], move.src_name, found, files[src_rank])
            block = sliced[local_slices(box, src_at)[:-1]]
            target[local_slices(box, dst_at)] = block
    return out


def _check_stored(spec: ParamSpec, name: str, found: tuple[str, list[int]], path: Path) -> None:
    # What the file's header says must be what the manifest says, before a slice is read from it.
    want = (_ST_DTYPES.get(spec.dtype, spec.dtype), list(spec.layout.shard_shape(spec.shape)))
    if found != want:
        raise ReshardError(
            f"checkpoint file {path} holds {name!r} as {found[0]}{found[1]}; the manifest says {want[0]}{want[1]}"
        )


def _shifted(layout: Layout, shape, rank: int, dim: int, offset: int) -> tuple[int, ...]:
    # Global origin of the rank's shard, moved so that a part at `offset` inside a fused shard lines up.
    at = [s.start for s in layout.global_slice(shape, rank)]
    if at:
        at[dim] -= offset
    return tuple(at)


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        raise ReshardError(f"dtype {name!r} cannot be written with numpy") from None
