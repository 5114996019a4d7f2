"""Multi-LoRA: several PEFT adapters, and the base model, in one batch.

An adapter directory in PEFT's format holds `adapter_config.json` (`r`, `lora_alpha`,
`use_rslora`) and `adapter_model.safetensors` with, per adapted linear layer,
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. The module
names are HF's, which are ms-models' own, so they map one to one.

The adapted linear layers are wrapped once (`LoRALinear`); before each forward the runner tells
every wrapper which rows of the flat batch belong to which adapter, and the wrapper adds

    y[rows of adapter a] += scale_a * (x A_a^T) B_a^T          scale = alpha / r (alpha / sqrt(r) with rsLoRA)

so rows of different adapters and of the base model share one batched forward (what vLLM's punica
kernels do on GPUs; here one masked low-rank product per active adapter). The tests check a batch
mixing two adapters and the base model against each adapter merged into the weights,
W' = W + scale * B A.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
from mindspore import Tensor, nn
from safetensors.numpy import load_file

from ms_models import linear

_PREFIX = "base_model.model."


class LoRAError(ValueError):
    """A LoRA adapter that cannot be served (bad directory, unknown module, wrong shape)."""


@dataclass
class Adapter:
    """One loaded adapter: per module name, (A [r, in], B [out, r]) and the common scale."""

    lora_id: int
    name: str
    scale: float
    weights: dict[str, tuple[Tensor, Tensor]]


class LoRALinear(nn.Cell):
    """A linear layer plus the low-rank updates of the adapters active in the current batch."""

    def __init__(self, base: nn.Cell):
        super().__init__()
        self.base = base
        self.active: list[tuple[Tensor, Tensor, Tensor, float]] = []
        """(row mask [T, 1], A, B, scale) per adapter present in the batch."""

    @property
    def weight(self):
        return self.base.weight

    def construct(self, x):
        y = self.base(x)
        for mask, a, b, scale in self.active:
            y = y + linear(linear(x * mask, a), b) * scale
        return y


def read_peft(path: str, max_rank: int | None = None) -> tuple[float, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(scale, {module: (A, B)}) of a PEFT adapter directory."""
    config_file = os.path.join(path, "adapter_config.json")
    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not (os.path.isfile(config_file) and os.path.isfile(weights_file)):
        raise LoRAError(f"{path!r} is not a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)")
    with open(config_file) as f:
        config = json.load(f)
    r, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if max_rank is not None and r > max_rank:
        raise LoRAError(f"adapter {path!r} has rank {r} > max_lora_rank={max_rank}")
    scale = alpha / np.sqrt(r) if config.get("use_rslora") else alpha / r
    tensors = load_file(weights_file)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if key.endswith(suffix):
                module = key[: -len(suffix)].removeprefix(_PREFIX)
                pairs.setdefault(module, {})[part] = value.astype(np.float32)
    out = {}
    for module, p in pairs.items():
        if set(p) != {"lora_A", "lora_B"}:
            raise LoRAError(f"adapter {path!r}: module {module!r} lacks lora_A or lora_B")
        out[module] = (p["lora_A"], p["lora_B"])
    if not out:
        raise LoRAError(f"adapter {path!r} has no lora_A/lora_B tensors")
    return float(scale), out


class LoRAManager:
    """Adapters by vLLM's lora_int_id, the wrapped layers, and the per-batch activation."""

    def __init__(self, model, max_loras: int, max_rank: int):
        self.model = model
        self.max_loras, self.max_rank = max_loras, max_rank
        self.adapters: dict[int, Adapter] = {}
        self.wrapped: dict[str, LoRALinear] = {}

    def _wrap(self, module: str) -> LoRALinear:
        if module in self.wrapped:
            return self.wrapped[module]
        if module.endswith("kv_b_proj"):
            # MLA's absorbed attention reads kv_b_proj.weight directly (W_UK, W_UV): an update applied
            # in the layer's forward would be skipped, so refuse instead of serving wrong tokens.
            raise LoRAError(f"LoRA on {module!r} is not supported (absorbed MLA reads the weight directly)")
        cells = dict(self.model.cells_and_names())
        if module not in cells or not hasattr(cells[module], "weight"):
            raise LoRAError(f"adapter targets {module!r}, which is not a linear layer of the model")
        parent_name, _, leaf = module.rpartition(".")
        wrapper = LoRALinear(cells[module])
        setattr(cells[parent_name] if parent_name else self.model, leaf, wrapper)
        self.wrapped[module] = wrapper
        return wrapper

    def add(self, lora_request) -> bool:
        """Load an adapter (a vllm LoRARequest) once; True when it is (already) loaded."""
        lora_id = lora_request.lora_int_id
        if lora_id in self.adapters:
            return True
        if len(self.adapters) >= self.max_loras:
            raise LoRAError(f"max_loras={self.max_loras} adapters already loaded")
        scale, pairs = read_peft(lora_request.lora_path, self.max_rank)
        weights = {}
        for module, (a, b) in pairs.items():
            base = self._wrap(module).base.weight
            out_f, in_f = base.shape
            if a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1]:
                raise LoRAError(f"{module}: lora_A {a.shape}, lora_B {b.shape} do not fit weight {tuple(base.shape)}")
            weights[module] = (Tensor(a), Tensor(b))
        self.adapters[lora_id] = Adapter(lora_id, lora_request.lora_name, scale, weights)
        return True

    def remove(self, lora_id: int) -> bool:
        return self.adapters.pop(lora_id, None) is not None

    def list(self) -> set[int]:
        return set(self.adapters)

    def set_batch(self, token_lora_ids: np.ndarray) -> None:
        """token_lora_ids [T]: the adapter of each flat-batch row (0: the base model)."""
        for wrapper in self.wrapped.values():
            wrapper.active = []
        for lora_id in np.unique(token_lora_ids):
            adapter = self.adapters.get(int(lora_id))
            if adapter is None:
                continue
            mask = Tensor((token_lora_ids == lora_id).astype(np.float32)[:, None])
            for module, (a, b) in adapter.weights.items():
                self.wrapped[module].active.append((mask, a, b, adapter.scale))
