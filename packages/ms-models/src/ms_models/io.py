"""Checkpoints in the Hugging Face layout: config.json plus *.safetensors, tensors named as in HF.

Our parameter names are HF's except in two places, mapped here both ways:
- routed experts are stacked in memory (`mlp.experts.gate_proj` [E, I, H]) and stored per expert on
  disk (`mlp.experts.{e}.gate_proj.weight`), the hub format DeepSeek-V3 and HF's save_pretrained use;
- MTP modules live in `model.mtp_layers.{k}` and are stored as `model.layers.{num_hidden_layers + k}`,
  as in DeepSeek-V3's checkpoint (which also stores copies of the shared embedding and head there).

Loading checks every name and shape before writing anything into the model, and reports all
missing, unexpected and mis-shaped tensors in one ModelError. Writing goes to a temporary name and
is renamed into place, with a manifest of sizes and SHA-256 sums that the loader verifies.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections.abc import Iterator

import numpy as np
from mindspore import Tensor
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from .config import DecoderConfig, load_config
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


def _safetensor_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, name) for name in files]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelError(f"no *.safetensors files in {path!r}")
    return files


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _verify_manifest(directory: str) -> None:
    manifest = os.path.join(directory, MANIFEST)
    if not os.path.exists(manifest):
        return  # a checkpoint written by another tool
    with open(manifest) as f:
        entries = json.load(f)["files"]
    for name, entry in entries.items():
        path = os.path.join(directory, name)
        if not os.path.exists(path) or os.path.getsize(path) != entry["size"] or _sha256(path) != entry["sha256"]:
            raise ModelError(f"{path!r} does not match {MANIFEST} (size or SHA-256 differs, or it is missing)")


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a file or an HF directory (sharded or not) as numpy arrays."""
    path = os.fspath(path)
    if os.path.isdir(path):
        _verify_manifest(path)
    tensors: dict[str, np.ndarray] = {}
    for file in _safetensor_files(path):
        try:
            part = load_file(file)
        except (SafetensorError, OSError) as exc:
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
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, "model.safetensors")
    tmp = target + ".tmp"
    save_file(hf_state_dict(model), tmp, metadata={"format": "pt"})
    os.replace(tmp, target)
    model.config.save(directory)
    write_manifest(directory, ["model.safetensors"])


def write_manifest(directory: str, names: list[str]) -> None:
    """Record size and SHA-256 of `names` (merged into an existing manifest)."""
    manifest = os.path.join(directory, MANIFEST)
    entries = {}
    if os.path.exists(manifest):
        with open(manifest) as f:
            entries = json.load(f)["files"]
    for name in names:
        path = os.path.join(directory, name)
        entries[name] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    tmp = manifest + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"version": 1, "files": entries}, f, indent=2, sort_keys=True)
    os.replace(tmp, manifest)


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
