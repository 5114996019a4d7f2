"""W8A8 static and W4A16 weight quantization: the checkpoint format, the quantizer, the MindSpore layers.

Formats (an HF directory whose config.json carries `quantization_config.quant_method`):

* `ms_w8a8` (W8A8 static, as vllm-ascend's w8a8_static): per linear layer `weight` int8 [out, in]
  (symmetric, per output channel), `weight_scale` float32 [out], `input_scale` float32 [1] (one
  per-tensor activation scale from calibration). At run time x is quantized with input_scale,
  multiplied in int32 (MindSpore's CPU int8 matmul wraps around in int8) and rescaled by
  input_scale * weight_scale.
* `ms_w4a16` (W4A16, LLM-Compressor's packed layout): `weight_packed` int32 [out, in / 8] (eight
  signed 4-bit values per int32, low nibble first), `weight_scale` float32 [out, in / group_size]
  (symmetric, per group), `weight_shape` int32 [2]. Activations stay float; the weight is unpacked
  to int8 once at load and dequantized per group in the matmul.

Quantized layers: every `Linear` of the decoder layers (attention, dense MLPs, shared experts) and
every routed expert's three projections (stored per expert as above, stacked again at load by
quant_experts.py); embeddings, norms, the router and the LM head stay float. MLA's `kv_b_proj` is
quantized in the checkpoint but dequantized once at load: absorbed attention multiplies by its two
halves (W_UK, W_UV) as float weights, as vLLM's MLA does with a quantized kv_b_proj, so its
quantization error counts and its run-time bytes stay float. `quantize_checkpoint` runs the float
model on calibration prompts to record each layer's input absolute maximum (forward pre-hooks,
PyNative; per expert, over the tokens routed to it) and writes the directory with
``ms_layout.files.atomic_dir`` (built under a temporary name, then swapped in; a folder left by a
killed run is removed by the next one).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore import dtype as mstype

from ms_layout.files import atomic_dir

from .quant_checks import METHODS, QuantError, check_group_size, check_method, check_source, check_target
from .quant_experts import EXPERT_WEIGHT, calibrate_experts, expert_bytes, expert_input_amax

#: quantized in the checkpoint, dequantized to a float Linear at load (absorbed MLA reads its weight)
DEQUANTIZED_AT_LOAD = ("kv_b_proj",)
__all__ = ["METHODS", "QuantError", "load_quantized", "quantize_checkpoint"]


# ------------------------------------------------------------------ math (numpy)
def quantize_w8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output channel: (q [out, in] int8, scale [out])."""
    scale = np.maximum(np.abs(w).max(1), 1e-12) / 127.0
    return np.clip(np.round(w / scale[:, None]), -127, 127).astype(np.int8), scale.astype(np.float32)


def quantize_w4(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int4 per group of `group` input columns: (q [out, in] in [-8, 7] as int8, scale [out, in/group])."""
    out_f, in_f = w.shape
    if in_f % group or in_f % 8:
        raise QuantError(f"in_features={in_f} must be a multiple of group_size={group} and of 8")
    g = w.reshape(out_f, in_f // group, group)
    scale = np.maximum(np.abs(g).max(-1), 1e-12) / 7.0
    q = np.clip(np.round(g / scale[..., None]), -8, 7).astype(np.int8).reshape(out_f, in_f)
    return q, scale.astype(np.float32)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """[out, in] int4 values (int8 in [-8, 7]) -> [out, in / 8] int32, value j in bits 4j..4j+3."""
    nibbles = (q.astype(np.int64) & 0xF).reshape(q.shape[0], -1, 8)
    packed = (nibbles << (4 * np.arange(8))).sum(-1)
    return packed.astype(np.uint32).view(np.int32)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """Inverse of pack_int4: [out, in / 8] int32 -> [out, in] int8."""
    u = packed.view(np.uint32).astype(np.int64)[..., None] >> (4 * np.arange(8))
    nibbles = (u & 0xF).astype(np.int8)
    return np.where(nibbles > 7, nibbles - 16, nibbles).astype(np.int8).reshape(packed.shape[0], -1)


# ------------------------------------------------------------------ MindSpore layers
class W8A8Linear(nn.Cell):
    """int8 weight per channel, int8 activation with a static per-tensor scale, int32 accumulation."""

    def __init__(self, weight: np.ndarray, weight_scale: np.ndarray, input_scale: float, bias=None):
        super().__init__()
        self.weight_q = Tensor(weight.astype(np.int32))  # int32: CPU int8 matmul wraps in int8
        self.weight_int8_bytes = weight.size
        self.input_scale = float(input_scale)
        self.dequant = Tensor((weight_scale * input_scale).astype(np.float32))
        self.bias = None if bias is None else Tensor(np.asarray(bias, np.float32))

    def construct(self, x):
        xq = ops.clip_by_value(ops.round(x / self.input_scale), Tensor(-128.0), Tensor(127.0)).astype(mstype.int32)
        y = ops.matmul(xq, self.weight_q.T).astype(mstype.float32) * self.dequant
        return y if self.bias is None else y + self.bias


class W4A16Linear(nn.Cell):
    """int4 weight in groups (held unpacked as int8), float activations."""

    def __init__(self, packed: np.ndarray, scale: np.ndarray, group: int, bias=None):
        super().__init__()
        q = unpack_int4(packed)
        self.out_f, self.in_f, self.group = q.shape[0], q.shape[1], group
        self.q = Tensor(q.reshape(self.out_f, self.in_f // group, group))
        self.scale = Tensor(np.asarray(scale, np.float32)[..., None])
        self.packed_bytes = packed.nbytes + scale.size * 4
        self.bias = None if bias is None else Tensor(np.asarray(bias, np.float32))

    def construct(self, x):
        w = (self.q.astype(mstype.float32) * self.scale).reshape(self.out_f, self.in_f)
        y = ops.matmul(x, w.T)
        return y if self.bias is None else y + self.bias


# ------------------------------------------------------------------ which layers
def quantizable(model) -> dict[str, nn.Cell]:
    """name -> Linear cell of every linear layer the formats quantize (routed experts aside; in a
    tensor-parallel shard the row-parallel ones too)."""
    out = {}
    for name, cell in model.cells_and_names():
        if not name.startswith(("model.layers.", "model.mtp_layers.")):
            continue
        if type(cell).__name__ in ("Linear", "RowParallelLinear"):
            out[name] = cell
    return out


def hub_name(model, name: str) -> str:
    """The checkpoint name of a layer (DeepSeek-V3's MTP module k is stored as layer L + k)."""
    from ms_models.io import checkpoint_names

    return next(checkpoint_names(model.config.num_hidden_layers, name, ()))[0]


def calibrate(model, prompts: list[list[int]]) -> dict[str, float]:
    """Checkpoint name -> input absolute maximum of every quantized layer over the calibration
    prompts (each routed expert's projections over the tokens routed to that expert)."""
    stats: dict[str, float] = {}
    handles = []
    for cell_name, cell in quantizable(model).items():
        hub = hub_name(model, cell_name)

        def hook(cell, inputs, name=hub):
            stats[name] = max(stats.get(name, 0.0), float(np.abs(inputs[0].asnumpy()).max()))

        handles.append(cell.register_forward_pre_hook(hook))

    def run():
        for p in prompts:
            model(Tensor(np.asarray([p], np.int32))).asnumpy()

    try:
        experts = calibrate_experts(model, run)
    finally:
        for h in handles:
            h.remove()
    stats.update(expert_input_amax(experts, lambda moe: hub_name(model, f"{moe}.experts")))
    return stats


def _quantize_layer(tensors: dict, name: str, w: np.ndarray, method: str, amax: float, group: int) -> int:
    """Put layer `name`'s quantized tensors into `tensors`; returns their bytes."""
    if method == "ms_w8a8":
        q, s = quantize_w8(w)
        tensors.update({f"{name}.weight": q, f"{name}.weight_scale": s})
        tensors[f"{name}.input_scale"] = np.array([max(amax, 1e-8) / 127.0], np.float32)
        return q.nbytes + s.nbytes + 4
    q, s = quantize_w4(w, group)
    packed = pack_int4(q)
    tensors.update({f"{name}.weight_packed": packed, f"{name}.weight_scale": s})
    tensors[f"{name}.weight_shape"] = np.array(w.shape, np.int32)
    return packed.nbytes + s.nbytes + 8


def quantize_checkpoint(src: str, dst: str, method: str, prompts: list[list[int]], group_size: int = 32) -> dict:
    """Quantize the float HF directory `src` into `dst`; returns a summary (layers, bytes)."""
    from safetensors.numpy import save_file

    import ms_models

    check_method(method)
    if method == "ms_w8a8" and not prompts:
        raise QuantError("W8A8 static needs calibration prompts for its activation scales")
    check_group_size(group_size)
    config = check_source(src)
    check_target(src, dst)
    model = ms_models.from_pretrained(src)
    tensors = ms_models.hf_state_dict(model)
    amax = calibrate(model, prompts) if method == "ms_w8a8" else {}
    names = [hub_name(model, cell_name) for cell_name in quantizable(model)]
    experts = [k[: -len(".weight")] for k in tensors if EXPERT_WEIGHT.match(k)]
    float_bytes = quant_bytes = 0
    for name in names + experts:
        w = tensors.pop(f"{name}.weight")
        float_bytes += w.nbytes
        quant_bytes += _quantize_layer(tensors, name, w, method, amax.get(name, 1.0), group_size)
    config["quantization_config"] = {"quant_method": method, "group_size": group_size}
    # check_target allowed replacing dst only if it is an earlier quantized checkpoint; the old one
    # stays in place until the new folder is complete.
    with atomic_dir(dst, overwrite=True) as tmp:
        for f in os.listdir(src):
            if (f.startswith("tokenizer") or f == "special_tokens_map.json") and os.path.isfile(os.path.join(src, f)):
                shutil.copy(os.path.join(src, f), tmp)
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(tmp, "model.safetensors"))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    return {
        "method": method,
        "layers": len(names),
        "expert_layers": len(experts),
        "float_bytes": float_bytes,
        "quantized_bytes": quant_bytes,
    }


def load_quantized(path: str, method: str):
    """An ms_models model whose quantized layers are W8A8Linear / W4A16Linear (routed experts:
    W8A8Experts / W4A16Experts) from `path` (quant_load.py; its TP/EP shard: load_quantized_shard)."""
    from .quant_load import load_quantized as load

    return load(path, method)


def weight_bytes(model) -> int:
    """Bytes of the weights in their stored format: int8 + scales (W8A8), packed int4 + group scales
    (W4A16), float32 for everything else."""
    total = 0
    for _, cell in model.cells_and_names():
        if isinstance(cell, W8A8Linear):
            total += cell.weight_int8_bytes + 4 * cell.dequant.shape[0]
        elif isinstance(cell, W4A16Linear):
            total += cell.packed_bytes
        else:
            total += expert_bytes(cell) or 0
    for p in model.get_parameters():
        total += 4 * int(np.prod(p.shape))
    return total


def register_vllm_quantization() -> None:
    """Make vLLM accept `quantization="ms_w8a8" / "ms_w4a16"` (and read it from config.json).

    The configs only carry the method name to the worker: the MindSpore layers above do the work,
    so no torch quantization method is ever built. The classes live in this module's namespace
    (`MsQuantConfig_<method>`), so vLLM's multiprocess executor can pickle a config holding one."""
    if all(f"MsQuantConfig_{m}" in globals() for m in METHODS):
        return  # (already registered in this process)
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    for method in METHODS:

        class _Config(QuantizationConfig):
            name = method

            def __init__(self, group_size: int = 32):
                super().__init__()
                self.group_size = group_size

            def get_name(self):
                return self.name

            def get_supported_act_dtypes(self):
                import torch

                return [torch.float32]

            @classmethod
            def get_min_capability(cls) -> int:
                return 0

            @staticmethod
            def get_config_filenames() -> list[str]:
                return []

            @classmethod
            def from_config(cls, config: dict):
                return cls(int(config.get("group_size", 32)))

            def get_quant_method(self, layer, prefix):
                return None

        _Config.__name__ = _Config.__qualname__ = f"MsQuantConfig_{method}"
        _Config.__module__ = __name__
        globals()[_Config.__name__] = _Config
        register_quantization_config(method)(_Config)


def __getattr__(name: str):
    """`MsQuantConfig_<method>` for unpickling in a fresh worker process (registers them first)."""
    if name.startswith("MsQuantConfig_"):
        register_vllm_quantization()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
