"""Checkpoints in the Hugging Face layout: config.json plus *.safetensors, tensors named as in HF.

Our parameter names are HF's except in two places, mapped here both ways:
- routed experts are stacked in memory (`mlp.experts.gate_proj` [E, I, H]) and stored per expert on
  disk (`mlp.experts.{e}.gate_proj.weight`), the hub format DeepSeek-V3 and HF's save_pretrained use;
- MTP modules live in `model.mtp_layers.{k}` and are stored as `model.layers.{num_hidden_layers + k}`,
  as in DeepSeek-V3's checkpoint (which also stores copies of the shared embedding and head there).

Loading checks every name and shape before writing anything into the model, and reports all
missing, unexpected and mis-shaped tensors in one ModelError. Every file name read from an index or
a manifest goes through ``ms_layout.files.safe_join`` (no ``..``, absolute names, symlinks out of
the folder or non-regular files), and the manifest is verified before any tensor is read. Writing
goes through ``ms_layout.files`` (temporary name, fsync, rename), with a manifest of sizes and
SHA-256 sums that the loader verifies.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterator

import numpy as np
from mindspore import Tensor
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from ms_layout.files import FileError, atomic_path, atomic_write_json, safe_join, sha256_file

from .config import DecoderConfig, load_config, read_config_json
from .errors import ModelError

MANIFEST = "ms_models_manifest.json"
_STACKED = re.compile(r"^(.*\.experts)\.(gate_proj|up_proj|down_proj)$")
_MTP = re.compile(r"^model\.mtp_layers\.(\d+)\.(.*)$")


def checkpoint_names(num_hidden_layers: int, name: str, shape: tuple[int, ...]) -> Iterator[tuple[str, int | None]]:
    """The on-disk name(s) of one parameter, with the expert index for stacked experts."""
    mtp = _MTP.match(name)
    if mtp:
        name = f"model.layers.{num_hidden_layers + int(mtp.group(1))}.{mtp.group(2)}"
    stacked = _STACKED.match(name)
    if stacked and len(shape) == 3:
        for e in range(shape[0]):
            yield f"{stacked.group(1)}.{e}.{stacked.group(2)}.weight", e
    else:
        yield name, None


def _params(model) -> dict[str, object]:
    return {name: p for name, p in model.parameters_and_names()}


def hf_state_dict(model) -> dict[str, np.ndarray]:
    """Every tensor of the model under its HF checkpoint name (float32 numpy arrays)."""
    out: dict[str, np.ndarray] = {}
    for name, param in _params(model).items():
        value = param.asnumpy()
        for hub, expert in checkpoint_names(model.config.num_hidden_layers, name, value.shape):
            out[hub] = np.ascontiguousarray(value if expert is None else value[expert])
    extra = getattr(model, "extra_hub_tensors", None)
    if extra is not None:
        out.update({k: np.ascontiguousarray(v) for k, v in extra().items()})
    return out


def load_state_dict(model, tensors: dict[str, np.ndarray], strict: bool = True) -> None:
    """Copy HF-named arrays into the model; all problems are reported together in one ModelError."""
    params = _params(model)
    ignorable = set(getattr(model, "ignored_hub_names", lambda: set())())
    expected: dict[str, tuple[str, int | None]] = {}
    for name, param in params.items():
        for hub, expert in checkpoint_names(model.config.num_hidden_layers, name, tuple(param.shape)):
            expected[hub] = (name, expert)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - ignorable)
    misshaped = []
    for hub, (name, expert) in expected.items():
        if hub in tensors:
            want = tuple(params[name].shape)[1:] if expert is not None else tuple(params[name].shape)
            got = tuple(np.shape(tensors[hub]))
            if got != want:
                misshaped.append(f"{hub}: checkpoint {got}, model {want}")
    if misshaped or (strict and (missing or unexpected)):
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {missing}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {unexpected}")
        if misshaped:
            parts.append(f"mis-shaped {len(misshaped)}: {misshaped}")
        raise ModelError("checkpoint does not match the model; " + "; ".join(parts))
    by_param: dict[str, list[tuple[int | None, np.ndarray]]] = {}
    for hub, (name, expert) in expected.items():
        if hub in tensors:
            by_param.setdefault(name, []).append((expert, tensors[hub]))
    for name, parts in by_param.items():
        param = params[name]
        if parts[0][0] is None:
            value = np.asarray(parts[0][1])
        else:
            if len(parts) != param.shape[0]:  # non-strict load with some experts missing
                continue
            value = np.stack([v for _, v in sorted(parts, key=lambda p: p[0])])
        param.set_data(Tensor(value.astype(np.float32)).astype(param.dtype))


def _inside(directory: str, name: object, what: str) -> str:
    """`name` (read from an index or a manifest) as a path inside `directory`, or a ModelError.

    A Hugging Face hub snapshot (``REPO/snapshots/REV/``) holds symlinks into ``REPO/blobs/``: those
    links, and only those, may leave the folder."""
    try:
        return os.fspath(safe_join(directory, name, what=what))
    except FileError as exc:
        blobs = _hub_blobs(directory)
        if blobs is None or "resolves to" not in str(exc):
            raise ModelError(str(exc)) from None
        try:
            return os.fspath(safe_join(blobs, os.path.relpath(os.path.realpath(os.path.join(directory, name)), blobs)))
        except FileError:
            raise ModelError(str(exc)) from None


def _hub_blobs(directory: str) -> str | None:
    """``REPO/blobs`` if `directory` is a hub cache snapshot ``REPO/snapshots/REV``, else None."""
    real = os.path.realpath(directory)
    parent = os.path.dirname(real)
    if os.path.basename(parent) != "snapshots":
        return None
    blobs = os.path.join(os.path.dirname(parent), "blobs")
    return blobs if os.path.isdir(blobs) else None


def _safetensor_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ModelError(f"no checkpoint at {path!r}: neither a folder nor a .safetensors file")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        data = read_config_json(index, "safetensors index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelError(f"{index!r} has no 'weight_map' object of tensor name -> file name")
        return [_inside(path, name, "index file") for name in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
    if not files:
        raise ModelError(f"no *.safetensors files in {path!r}")
    return [_inside(path, os.path.basename(f), "safetensors file") for f in files]


def _verify_manifest(directory: str) -> None:
    manifest = os.path.join(directory, MANIFEST)
    if not os.path.lexists(manifest):
        return  # a checkpoint written by another tool
    entries = _manifest_entries(directory)
    for name, entry in entries.items():
        path = _inside(directory, name, f"{MANIFEST} file")
        if os.path.getsize(path) != entry["size"] or sha256_file(path) != entry["sha256"]:
            raise ModelError(f"{path!r} does not match {MANIFEST} (size or SHA-256 differs)")


def _manifest_entries(directory: str) -> dict[str, dict]:
    """The {name: {size, sha256}} entries of a checkpoint's manifest, each field checked."""
    manifest = os.path.join(directory, MANIFEST)
    _inside(directory, MANIFEST, "manifest")  # a regular file inside the folder, not a link out
    data = read_config_json(manifest, "manifest")
    entries = data.get("files") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise ModelError(f"{manifest!r} has no 'files' object of name -> {{size, sha256}}")
    for name, entry in entries.items():
        size = entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ModelError(f"{manifest!r}: files[{name!r}].size = {size!r}; expected a non-negative int")
        if not isinstance(digest, str) or len(digest) != 64:
            raise ModelError(f"{manifest!r}: files[{name!r}].sha256 = {digest!r:.80}; expected 64 hex digits")
    return entries


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a file or an HF directory (sharded or not) as numpy arrays."""
    path = os.fspath(path)
    if os.path.isdir(path):
        _verify_manifest(path)
    tensors: dict[str, np.ndarray] = {}
    for file in _safetensor_files(path):
        try:
            part = load_file(file)
        except (SafetensorError, OSError, ValueError, TypeError) as exc:  # safetensors' errors for bad headers
            raise ModelError(f"cannot read {file!r}: {exc}") from None
        for key, value in part.items():
            if key in tensors:
                raise ModelError(f"tensor {key!r} appears in more than one file of {path!r}")
            tensors[key] = value.astype(np.float32) if value.dtype != np.float32 else value
    return tensors


def load_safetensors(model, path: str | os.PathLike, strict: bool = True) -> None:
    """Load HF-named safetensors (a file or a directory) into `model`; ModelError lists any mismatch."""
    load_state_dict(model, read_safetensors(path), strict=strict)


def save_safetensors(model, path: str | os.PathLike) -> None:
    """Write `model` as an HF directory: config.json, model.safetensors and a checksum manifest."""
    directory = os.fspath(path)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ModelError(f"{directory!r} is a file, not a checkpoint folder")
    os.makedirs(directory, exist_ok=True)
    with atomic_path(os.path.join(directory, "model.safetensors")) as tmp:
        save_file(hf_state_dict(model), str(tmp), metadata={"format": "pt"})
    model.config.save(directory)
    write_manifest(directory, ["model.safetensors"])


def write_manifest(directory: str, names: list[str]) -> None:
    """Record size and SHA-256 of `names` (merged into an existing manifest)."""
    manifest = os.path.join(directory, MANIFEST)
    entries = _manifest_entries(directory) if os.path.lexists(manifest) else {}
    for name in names:
        path = os.path.join(directory, name)
        entries[name] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
    atomic_write_json(manifest, {"version": 1, "files": entries}, indent=2, sort_keys=True)


def model_class(config: DecoderConfig):
    """The CausalLM class for a config's model_type."""
    from .deepseek_v3 import DeepseekV3ForCausalLM
    from .dense import LlamaForCausalLM, Qwen2ForCausalLM

    classes = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "deepseek_v3": DeepseekV3ForCausalLM}
    return classes[config.model_type]


def from_config(config: DecoderConfig, seed: int = 0):
    """A randomly initialised model (seeded) for a config."""
    return model_class(config)(config, seed=seed)


def from_pretrained(path: str | os.PathLike, strict: bool = True):
    """Build the model named by config.json's model_type and load its safetensors."""
    config = load_config(path)
    model = from_config(config)
    load_safetensors(model, path, strict=strict)
    return model
