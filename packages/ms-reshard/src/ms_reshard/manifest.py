"""Reading and checking a checkpoint's manifest.json, field by field, before anything it names is used.

A manifest comes from disk and may be damaged, hand-edited or hostile: every field is checked for
its type and range (bools are not ints, shapes are lists of non-negative ints, dtypes come from the
set numpy-backed safetensors can hold, layouts parse and hold their shapes, ranks are within
MS_RESHARD_MAX_RANKS), the params and the files must agree with each other, and every file must be
large enough for the shards the manifest says it holds, so a huge claimed shape is refused before
anything is allocated. A problem is a ReshardError naming the field and its value.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from ms_layout import Layout, LayoutError
from ms_layout.files import FileError, read_json, safe_join

from .errors import ReshardError
from .limits import (
    MAX_LAYERS,
    MAX_MANIFEST_BYTES,
    MAX_RANKS,
    check_count,
    check_layout,
    check_mesh_data,
    check_shape,
    is_int,
    short_repr,
)
from .model_plan import ITEMSIZE, ParamSpec

FORMAT = "ms-reshard-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"

CHECKPOINT_DTYPES = tuple(d for d in ITEMSIZE if d != "bfloat16")
"""dtypes a checkpoint may hold: safetensors' numpy reader has no bfloat16."""

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _bad(where: str, field: str, value: Any, expected: str) -> ReshardError:
    return ReshardError(f"{where}: {field} = {short_repr(value)}; expected {expected}")


def load_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a checkpoint folder, read within MS_RESHARD_MAX_MANIFEST_BYTES and checked
    field by field (check_manifest)."""
    directory = Path(directory)
    if not directory.exists():
        raise ReshardError(f"checkpoint folder {os.fspath(directory)!r} does not exist")
    if not directory.is_dir():
        raise ReshardError(f"{os.fspath(directory)!r} is a file, not a checkpoint folder")
    try:
        path = safe_join(directory, MANIFEST, what="manifest", max_bytes=1 << 62)
    except FileError as exc:
        if not (directory / MANIFEST).exists():
            raise ReshardError(f"{os.fspath(directory)} is not a checkpoint: {MANIFEST} is missing") from None
        raise ReshardError(str(exc)) from None
    check_count(path.stat().st_size, MAX_MANIFEST_BYTES, f"size of {os.fspath(path)}")
    try:
        manifest = read_json(path, "manifest", max_bytes=MAX_MANIFEST_BYTES.value)
    except FileError as exc:
        raise ReshardError(str(exc)) from None
    check_manifest(manifest, os.fspath(path))
    return manifest


def check_manifest(manifest: Any, where: str = "manifest") -> dict[str, ParamSpec]:
    """Check a manifest's structure and consistency; returns its parameter specs."""
    if not isinstance(manifest, dict):
        raise ReshardError(f"{where} holds a JSON {type(manifest).__name__}, expected an object")
    if manifest.get("format") != FORMAT:
        raise _bad(where, "format", manifest.get("format"), repr(FORMAT))
    version = manifest.get("version")
    if not is_int(version) or not 1 <= version <= VERSION:
        raise _bad(where, "version", version, f"an int in 1..{VERSION} (this reader's versions)")
    if manifest.get("config") is not None and not isinstance(manifest["config"], dict):
        raise _bad(where, "config", manifest["config"], "null or a ParallelConfig object")
    _check_model(manifest.get("model"), where)
    params = manifest.get("params")
    if not isinstance(params, dict):
        raise _bad(where, "params", params, "an object {name: {shape, dtype, layout}}")
    specs = {name: _param_spec(name, p, where) for name, p in params.items()}
    files = check_files(manifest, where)
    _check_agree(specs, files, where)
    return specs


def manifest_specs(manifest: dict) -> dict[str, ParamSpec]:
    """Parameter specs recorded in a manifest (checked: a bad entry is a ReshardError)."""
    return check_manifest(manifest)


def _check_model(model: Any, where: str) -> None:
    if model is None:
        return
    if not isinstance(model, dict):
        raise _bad(where, "model", model, "an object of model facts")
    layers = model.get("num_layers")
    if layers is not None:
        if not is_int(layers) or layers < 1:
            raise _bad(where, "model.num_layers", layers, "a positive int")
        check_count(layers, MAX_LAYERS, f"{where}: model.num_layers")
    experts = model.get("num_experts")
    if experts is not None and (not is_int(experts) or experts < 1):
        raise _bad(where, "model.num_experts", experts, "null or a positive int")


def parse_layout_data(data: Any, what: str) -> Layout:
    """A Layout with a tensor map from its dict form, within the rank limits."""
    if not isinstance(data, dict):
        raise ReshardError(f"{what} = {short_repr(data)}; expected a layout object")
    sizes, names = data.get("device_matrix"), data.get("alias_names")
    if not isinstance(sizes, list) or not isinstance(names, list):
        raise ReshardError(f"{what}: device_matrix and alias_names must be lists, got {short_repr(data)}")
    check_mesh_data(data, what)
    ranks = data.get("rank_list")
    if ranks is not None and (not isinstance(ranks, list) or not all(is_int(r) and r >= 0 for r in ranks)):
        raise ReshardError(f"{what}.rank_list = {short_repr(ranks)}; expected null or a list of non-negative ints")
    dims = data.get("dims")
    if not isinstance(dims, list) or not all(isinstance(d, list) and all(isinstance(a, str) for a in d) for d in dims):
        raise ReshardError(f"{what}.dims = {short_repr(dims)}; expected a list of lists of mesh axis names")
    try:
        layout = Layout.from_dict(data)
    except LayoutError as exc:
        raise ReshardError(f"{what}: {exc}") from None
    return check_layout(layout, what)


def _param_spec(name: Any, p: Any, where: str) -> ParamSpec:
    field = f"params[{name!r}]"
    if not isinstance(name, str) or not name:
        raise _bad(where, "params key", name, "a non-empty parameter name")
    if not isinstance(p, dict):
        raise _bad(where, field, p, "an object {shape, dtype, layout}")
    dtype = p.get("dtype")
    if not isinstance(dtype, str) or dtype not in CHECKPOINT_DTYPES:
        raise _bad(where, f"{field}.dtype", dtype, f"one of {list(CHECKPOINT_DTYPES)}")
    shape = check_shape(p.get("shape"), ITEMSIZE[dtype], f"{where}: {field}.shape")
    layout = parse_layout_data(p.get("layout"), f"{where}: {field}.layout")
    if layout.ndim != len(shape):
        raise ReshardError(f"{where}: {field}.layout has {layout.ndim} dims for shape {list(shape)}")
    try:
        layout.shard_shape(shape)
    except LayoutError as exc:
        raise ReshardError(f"{where}: {field}.layout cannot hold shape {list(shape)}: {exc}") from None
    parts, part_dim = p.get("parts", []), p.get("part_dim", 0)
    if not isinstance(parts, list) or not all(is_int(n) and n >= 0 for n in parts) or len(parts) == 1:
        raise _bad(where, f"{field}.parts", parts, "absent, or a list of 2+ non-negative part sizes")
    if not is_int(part_dim) or not 0 <= part_dim < max(len(shape), 1):
        raise _bad(where, f"{field}.part_dim", part_dim, f"an int in 0..{max(len(shape) - 1, 0)}")
    if parts:
        if sum(parts) != shape[part_dim]:
            raise ReshardError(f"{where}: {field}.parts {parts} do not add up to shape[{part_dim}] = {shape[part_dim]}")
        split = layout.splits[part_dim]
        if any(n % split for n in parts):
            raise ReshardError(f"{where}: {field}.parts {parts} do not split into {split} shards each")
    return ParamSpec(layout, shape, dtype, tuple(parts), part_dim)


def check_files(manifest: dict, where: str = "manifest") -> dict[int, dict]:
    """The manifest's files by rank, each entry checked for its fields' types."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise _bad(where, "files", files, "an object {rank: {path, bytes, sha256, tensors}}")
    out = {}
    for key, entry in files.items():
        if not isinstance(key, str) or not key.isascii() or not key.isdigit() or str(int(key)) != key:
            raise _bad(where, "files key", key, "a rank number such as '0'")
        rank = check_count(int(key), MAX_RANKS, f"{where}: files key (a rank number)")
        field = f"files[{key!r}]"
        if not isinstance(entry, dict):
            raise _bad(where, field, entry, "an object {path, bytes, sha256, tensors}")
        if not isinstance(entry.get("path"), str) or not entry["path"]:
            raise _bad(where, f"{field}.path", entry.get("path"), "a file name inside the checkpoint folder")
        size = entry.get("bytes")
        if not is_int(size) or size < 0:
            raise _bad(where, f"{field}.bytes", size, "a non-negative int")
        digest = entry.get("sha256")
        if not isinstance(digest, str) or not _HEX64.match(digest):
            raise _bad(where, f"{field}.sha256", digest, "64 lowercase hex digits")
        tensors = entry.get("tensors")
        if not isinstance(tensors, list) or not all(isinstance(t, str) for t in tensors):
            raise _bad(where, f"{field}.tensors", tensors, "a list of parameter names")
        if len(set(tensors)) != len(tensors):
            raise ReshardError(f"{where}: {field}.tensors names a parameter twice")
        out[rank] = entry
    return out


def _check_agree(specs: dict[str, ParamSpec], files: dict[int, dict], where: str) -> None:
    """Every shard a layout places has a file that lists it, every listed tensor is placed there,
    and every file is large enough for the shards it lists (so none is read past its end)."""
    holders: dict[int, set[str]] = {}
    for name, spec in specs.items():
        for rank in spec.layout.ranks:
            holders.setdefault(rank, set()).add(name)
    for rank, names in sorted(holders.items()):
        if rank not in files:
            first = sorted(names)[0]
            raise ReshardError(f"{where}: params[{first!r}] is placed on rank {rank}, which has no entry in files")
    for rank, entry in files.items():
        listed = set(entry["tensors"])
        want = holders.get(rank, set())
        if listed != want:
            extra, missing = sorted(listed - want), sorted(want - listed)
            detail = f"lists {extra[0]!r}, which its layout does not place there" if extra else f"omits {missing[0]!r}"
            raise ReshardError(f"{where}: files[{str(rank)!r}].tensors {detail}")
        need = sum(math.prod(specs[n].layout.shard_shape(specs[n].shape)) * ITEMSIZE[specs[n].dtype] for n in listed)
        if need > entry["bytes"]:
            raise ReshardError(
                f"{where}: files[{str(rank)!r}].bytes = {entry['bytes']}, but the shards it lists need {need} bytes"
            )
