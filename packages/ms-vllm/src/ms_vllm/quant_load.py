"""Loading a quantized checkpoint (quant.py's formats): the whole model, or one tensor/expert/data-
parallel rank's shard of it.

A shard is cut by ms_models.parallel exactly as a float one (the local config, the communicating
cells, `read_shards`' lazy slices); the quantized tensors travel with their weight's layout: int8
values and packed int4 words split like the float weight would be, a per-output-channel scale with
the weight's rows, group scales with its rows and columns, the activation scale whole. A row-parallel
layer (o_proj, down_proj) becomes a RowParallelWrapper (ms_models.parallel) around the quantized
product of the rank's input columns, then the same all-reduce (and bias once) as a float
RowParallelLinear. Routed experts are stacked per rank: its own experts under EP, its columns of every
expert under TP.
"""

from __future__ import annotations

import os

import numpy as np

from ms_models.parallel import RowParallelLinear, RowParallelWrapper

from .quant import DEQUANTIZED_AT_LOAD, W4A16Linear, W8A8Linear, hub_name, quantizable, unpack_int4
from .quant_checks import QuantError, check_group_size, check_method, check_source
from .quant_experts import stack_experts


def inner_features(layer) -> tuple[int, int]:
    """(in, out) of a quantized linear."""
    if isinstance(layer, W4A16Linear):
        return layer.in_f, layer.out_f
    return int(layer.weight_q.shape[1]), int(layer.weight_q.shape[0])


def _dequantize(raw: dict, name: str, method: str, group: int) -> np.ndarray:
    """Pop layer `name`'s quantized tensors from `raw`; its float weight (for DEQUANTIZED_AT_LOAD)."""
    if method == "ms_w8a8":
        raw.pop(f"{name}.input_scale")
        return raw.pop(f"{name}.weight").astype(np.float32) * raw.pop(f"{name}.weight_scale")[:, None]
    raw.pop(f"{name}.weight_shape", None)
    q = unpack_int4(raw.pop(f"{name}.weight_packed"))
    s = raw.pop(f"{name}.weight_scale")
    return (q.reshape(q.shape[0], -1, group) * s[..., None]).reshape(q.shape).astype(np.float32)


def _quant_config(path: str, method: str) -> int:
    """Check that `path` is a `method` checkpoint; its group size."""
    check_method(method)
    quant_config = check_source(path).get("quantization_config")
    if not isinstance(quant_config, dict) or quant_config.get("quant_method") != method:
        found = quant_config.get("quant_method") if isinstance(quant_config, dict) else None
        raise QuantError(f"{path!r} is not an {method} checkpoint (quantization_config.quant_method = {found!r:.50})")
    group = quant_config.get("group_size", 32)
    check_group_size(group)
    return group


def install(model, raw: dict, method: str, group: int, where: str) -> None:
    """Swap the quantized layers of `model` (whole or a shard) in, built from (and popped off) `raw`;
    load the rest of `raw` as float weights."""
    import ms_models

    cells = dict(model.cells_and_names())
    replaced = {}
    for cell_name, cell in quantizable(model).items():
        name = hub_name(model, cell_name)
        bias = raw.pop(f"{name}.bias", None)
        needed = ("weight", "weight_scale", "input_scale") if method == "ms_w8a8" else ("weight_packed", "weight_scale")
        missing = [f"{name}.{k}" for k in needed if f"{name}.{k}" not in raw]
        if missing:
            raise QuantError(f"{where!r} lacks the quantized tensors {missing[:3]}")
        if cell_name.endswith(DEQUANTIZED_AT_LOAD):
            raw[f"{name}.weight"] = _dequantize(raw, name, method, group)
            if bias is not None:
                raw[f"{name}.bias"] = bias
            continue
        row_parallel = isinstance(cell, RowParallelLinear)
        inner_bias = None if row_parallel else bias  # a row-parallel bias is added once, after the sum
        if method == "ms_w8a8":
            w, s = raw.pop(f"{name}.weight"), raw.pop(f"{name}.weight_scale")
            layer = W8A8Linear(w, s, raw.pop(f"{name}.input_scale")[0], inner_bias)
        else:
            raw.pop(f"{name}.weight_shape", None)
            layer = W4A16Linear(raw.pop(f"{name}.weight_packed"), raw.pop(f"{name}.weight_scale"), group, inner_bias)
        if row_parallel:
            layer = RowParallelWrapper(layer, bias, cell.group, *inner_features(layer))
        parent, _, leaf = cell_name.rpartition(".")
        replaced[(parent, leaf)] = layer
    for cell_name, cell in cells.items():
        if type(cell).__name__ == "Experts":
            parent, _, leaf = cell_name.rpartition(".")
            replaced[(parent, leaf)] = stack_experts(raw, hub_name(model, cell_name), cell.num_experts, method, group)
    for (parent, leaf), layer in replaced.items():
        setattr(cells[parent], leaf, layer)
    ms_models.load_state_dict(model, {k: v.astype(np.float32) for k, v in raw.items()}, strict=False)


def load_quantized(path: str, method: str):
    """The whole quantized model at `path` (see quant.load_quantized)."""
    from safetensors.numpy import load_file

    import ms_models

    group = _quant_config(path, method)
    model = ms_models.from_config(ms_models.load_config(path), seed=0)
    raw = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            raw.update(load_file(os.path.join(path, f)))
    install(model, raw, method, group, path)
    return model


def load_quantized_shard(path: str, method: str, plan, group):
    """This rank's shard (ms_models.parallel.ShardPlan `plan`, collectives over `group`) of the
    quantized model at `path`; only the rank's slices are read."""
    import ms_models
    from ms_models.parallel import local_config, read_shards, shard_cells

    bits = _quant_config(path, method)
    config = ms_models.load_config(path)
    model = ms_models.from_config(local_config(config, plan), seed=0)
    shard_cells(model, config, plan, group)
    install(model, read_shards(path, config, plan), method, bits, path)
    model.set_train(False)
    return model
