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
hold each part's shard side by side, see fusion.py). Every file is checked against its size and
sha256 before anything is read from it, and a checkpoint is written to a temporary directory next
to the target and renamed into place: a failure at any point leaves the target as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ms_layout import Layout, LayoutError, ParallelConfig

from .errors import ReshardError
from .local import local_slices
from .model_plan import ModelPlan, ParamSpec

FORMAT = "ms-reshard-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"


def _file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def sha256_file(path: Path, progress: Any = None, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks (updating a tqdm bar by bytes if given)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if progress is not None:
                progress.update(len(block))
    return h.hexdigest()


@contextlib.contextmanager
def atomic_dir(target: Path, overwrite: bool = False):
    """Yield a fresh temporary directory beside `target`; on success it replaces `target`."""
    target = Path(target)
    if target.exists() and not overwrite:
        raise ReshardError(f"{target} already exists; pass overwrite=True (--overwrite) to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, old / "d")
        os.rename(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
    return {"path": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path), "tensors": names}


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


def load_manifest(directory: str | Path) -> dict:
    """The manifest of a checkpoint directory, checked for format and version."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReshardError(f"{directory} is not a checkpoint: {MANIFEST} is missing") from None
    except json.JSONDecodeError as exc:
        raise ReshardError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ReshardError(f"{path} is not an {FORMAT} manifest")
    if not isinstance(manifest.get("version"), int) or manifest["version"] > VERSION:
        raise ReshardError(f"{path} has version {manifest.get('version')!r}; this reader knows 1..{VERSION}")
    return manifest


def manifest_specs(manifest: dict) -> dict[str, ParamSpec]:
    """Parameter specs recorded in a manifest."""
    try:
        return {
            n: ParamSpec(
                Layout.from_dict(p["layout"]),
                tuple(p["shape"]),
                p["dtype"],
                tuple(p.get("parts", ())),
                p.get("part_dim", 0),
            )
            for n, p in manifest["params"].items()
        }
    except (KeyError, TypeError, LayoutError) as exc:
        raise ReshardError(f"manifest has a bad parameter entry: {exc}") from None


def verify(directory: str | Path, manifest: dict, progress: bool = False) -> None:
    """Check every file's size and sha256 against the manifest; a mismatch names the file."""
    directory = Path(directory)
    entries = list(manifest["files"].values())
    bar = _bar(sum(e["bytes"] for e in entries), "verify", progress)
    try:
        for entry in entries:
            path = directory / entry["path"]
            if not path.is_file():
                raise ReshardError(f"checkpoint file {path} is missing")
            size = path.stat().st_size
            if size != entry["bytes"]:
                raise ReshardError(f"checkpoint file {path} has {size} bytes; the manifest says {entry['bytes']}")
            if sha256_file(path, bar) != entry["sha256"]:
                raise ReshardError(f"checkpoint file {path} is corrupted: its sha256 does not match the manifest")
    finally:
        if bar is not None:
            bar.close()


def _bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False)


def load_checkpoint(directory: str | Path) -> tuple[dict[str, ParamSpec], dict[str, dict[int, np.ndarray]]]:
    """Read a whole checkpoint (verified) as specs and {name: {rank: shard}}."""
    from safetensors.numpy import load_file

    manifest = load_manifest(directory)
    verify(directory, manifest)
    shards: dict[str, dict[int, np.ndarray]] = {}
    for rank, entry in manifest["files"].items():
        for name, array in load_file(str(Path(directory) / entry["path"])).items():
            shards.setdefault(name, {})[int(rank)] = array
    return manifest_specs(manifest), shards


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
    files = {int(r): src_dir / e["path"] for r, e in manifest["files"].items()}
    by_rank: dict[int, list] = {}
    for move in plan.moves:
        for rank, pieces in move.plan.sources_by_rank().items():
            by_rank.setdefault(rank, []).append((move, pieces))
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
                readers[src_rank] = stack.enter_context(safe_open(str(files[src_rank]), framework="numpy"))
            src_at = _shifted(p.src, p.shape, src_rank, move.dim, move.src_offset)
            try:
                block = readers[src_rank].get_slice(move.src_name)[local_slices(box, src_at)[:-1]]
            except Exception as exc:  # safetensors raises its own error types for missing names
                raise ReshardError(f"cannot read {move.src_name!r} from rank {src_rank}'s file: {exc}") from None
            target[local_slices(box, dst_at)] = block
    return out


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
