"""Multi-LoRA: several PEFT adapters, and the base model, in one batch, eager or compiled.

An adapter directory in PEFT's format holds `adapter_config.json` (`r`, `lora_alpha`,
`use_rslora`) and `adapter_model.safetensors` with, per adapted linear layer,
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. The module
names are HF's, which are ms-models' own, so they map one to one.

At start-up every adaptable linear layer of the decoder is wrapped (`LoRALinear`), as vLLM wraps
its layers before any adapter is known, so that a compiled graph never changes shape: each wrapper
holds a bank of `max_loras` slots of rank `max_lora_rank`, A [slots * R, in] and B [out, slots * R]
(an adapter of lower rank is zero-padded, a slot without an adapter is zero), and every wrapper
reads one shared token mask M [tokens, slots * R], whose row t holds the adapter scale in the
columns of token t's slot and zeros elsewhere. Then, for every row of the flat batch at once,

    y = x W^T + ((x A^T) * M) B^T          scale = alpha / r (alpha / sqrt(r) with rsLoRA)

two thin GEMMs per layer whatever the mix of adapters (what vLLM's punica kernels do on GPUs).
The banks and the mask are Parameters written with `ops.assign` (a compiled graph reads a
Parameter's buffer; `set_data` would swap the buffer under it, docs/mindspore-cpu.md), so the same
graph serves any adapters and any batch. The tests check a batch mixing two adapters and the base
model against each adapter merged into the weights, W' = W + scale * B A, eager and compiled.

Under tensor parallel (`shard=(rank, size)`) each rank holds its slice of every adapter, cut as
vLLM's LoRA layers cut theirs: a column-parallel layer's B by output rows (A whole), a row-parallel
layer's A by input columns (B whole), a replicated layer's both whole. The row-parallel product
((x_r A_r^T) * M) B^T is a partial sum like x_r W_r^T, so the wrapper adds it before the layer's one
all-reduce (ms_models.parallel.RowParallelWrapper): no extra collective.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from safetensors.numpy import load_file

from ms_models import linear
from ms_models.parallel import RowParallelLinear, RowParallelWrapper

_PREFIX = "base_model.model."
#: the decoder's linear layers LoRA adapts (HF names; MLA's kv_b_proj is read as a weight by the
#: absorbed attention, and routed experts are stacked tensors, so neither is here)
ADAPTABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
             "kv_a_proj_with_mqa")  # fmt: skip


class LoRAError(ValueError):
    """A LoRA adapter that cannot be served (bad directory, unknown module, wrong shape)."""


@dataclass
class Adapter:
    """One loaded adapter: its slot in the banks, scale and the modules it adapts."""

    lora_id: int
    name: str
    slot: int
    scale: float
    modules: tuple[str, ...]
    last_used: int = 0
    """The batch counter when a batch last used it (the least recently used is evicted first)."""


def _zeros(shape: tuple[int, ...], name: str) -> Parameter:
    return Parameter(Tensor(np.zeros(shape, np.float32)), name=name, requires_grad=False)


class LoRALinear(nn.Cell):
    """A linear layer plus the low-rank updates of every adapter slot, masked per token."""

    def __init__(self, base: nn.Cell, name: str, width: int, mask: Parameter):
        super().__init__()
        self.base = base
        out_f, in_f = base.weight.shape
        self.lora_a = _zeros((width, in_f), f"{name}.lora_a")
        self.lora_b = _zeros((out_f, width), f"{name}.lora_b")
        self.mask = mask  # shared by every wrapper: [token capacity, width]

    @property
    def weight(self):
        return self.base.weight

    def construct(self, x):
        xa = linear(x, self.lora_a)
        rows = 1
        for d in xa.shape[:-1]:
            rows *= d
        xa = (xa.reshape(rows, -1) * self.mask[:rows]).reshape(xa.shape)
        return self.base(x) + linear(xa, self.lora_b)


class PartialProduct(nn.Cell):
    """A row-parallel layer's own product x_r W_r^T, before its all-reduce (LoRA adds its partial)."""

    def __init__(self, row_parallel):
        super().__init__()
        self.row_parallel = row_parallel

    @property
    def weight(self):
        return self.row_parallel.weight

    def construct(self, x):
        return linear(x, self.row_parallel.weight)


def shard_pair(a: np.ndarray, b: np.ndarray, local: tuple[int, int], shard: tuple[int, int]):
    """This rank's (A, B) of an adapter pair for a layer whose local weight is `local` (out, in):
    rows of B where the layer's outputs are split, columns of A where its inputs are."""
    rank, size = shard
    out_f, in_f = local
    if b.shape[0] == out_f * size and size > 1 and b.shape[0] != out_f:
        b = b[rank * out_f : (rank + 1) * out_f]
    if a.shape[1] == in_f * size and size > 1 and a.shape[1] != in_f:
        a = a[:, rank * in_f : (rank + 1) * in_f]
    return a, b


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
    """Adapters by vLLM's lora_int_id in bank slots, the wrapped layers, and the token mask."""

    def __init__(self, model, max_loras: int, max_rank: int, max_tokens: int = 256, shard=(0, 1)):
        self.model = model
        self.shard = (int(shard[0]), int(shard[1]))
        """(rank, size) of the tensor-parallel group whose slice of each adapter this rank holds."""
        self.max_loras, self.max_rank = int(max_loras), int(max_rank)
        self.width = self.max_loras * self.max_rank
        self.known: dict[int, tuple[str, float, dict]] = {}
        """Every adapter added, loaded into a slot or not: lora_int_id -> (name, scale, {module: (A, B)}),
        read once (a reload after an eviction does not read the files again)."""
        self.adapters: dict[int, Adapter] = {}
        """The adapters holding a bank slot."""
        self._batches = 0
        self.mask = _zeros((max_tokens, self.width), "lora_token_mask")
        self.wrapped: dict[str, LoRALinear] = {}
        cells = dict(model.cells_and_names())
        for name, cell in cells.items():
            adaptable = name.startswith("model.layers.") and name.endswith(ADAPTABLE)
            if adaptable and type(cell).__name__ in ("Linear", "RowParallelLinear"):
                parent_name, _, leaf = name.rpartition(".")
                if isinstance(cell, RowParallelLinear):  # LoRA's partial joins the layer's all-reduce
                    wrapper = LoRALinear(PartialProduct(cell), name, self.width, self.mask)
                    bias = None if cell.bias is None else cell.bias.asnumpy()
                    layer = RowParallelWrapper(wrapper, bias, cell.group, cell.in_features, cell.out_features)
                else:
                    wrapper = layer = LoRALinear(cell, name, self.width, self.mask)
                setattr(cells[parent_name], leaf, layer)
                self.wrapped[name] = wrapper
        if not self.wrapped:
            raise LoRAError(f"{type(model).__name__} has no linear layer LoRA can adapt ({', '.join(ADAPTABLE)})")

    @property
    def max_tokens(self) -> int:
        """Rows of the flat batch a forward may have (the token mask's)."""
        return int(self.mask.shape[0])

    def reserve(self, tokens: int) -> None:
        """Make room for batches of `tokens` rows (before anything is compiled: it replaces the mask)."""
        if tokens <= self.max_tokens:
            return
        self.mask = _zeros((tokens, self.width), "lora_token_mask")
        for wrapper in self.wrapped.values():
            wrapper.mask = self.mask

    def add(self, lora_request) -> bool:
        """Register an adapter (a vllm LoRARequest), read and checked against the model now; it takes
        a bank slot when a batch first uses it. True when it is (already) registered."""
        lora_id = lora_request.lora_int_id
        if lora_id not in self.known:
            self.known[lora_id] = (lora_request.lora_name, *self._read(lora_request))
        return True

    def _read(self, lora_request) -> tuple[float, dict[str, tuple[np.ndarray, np.ndarray]]]:
        scale, pairs = read_peft(lora_request.lora_path, self.max_rank)
        for module, (a, b) in pairs.items():
            if module not in self.wrapped:
                raise LoRAError(
                    f"adapter targets {module!r}, which is not an adaptable linear layer of the model "
                    f"(MLA's kv_b_proj, routed experts, embeddings and the head are not adapted)"
                )
            out_f, in_f = self.wrapped[module].base.weight.shape
            local_a, local_b = shard_pair(a, b, (out_f, in_f), self.shard)
            if local_a.shape[1] != in_f or local_b.shape[0] != out_f or a.shape[0] != b.shape[1]:
                size = self.shard[1]
                whole = f" (this rank's 1/{size} slice of the layer)" if size > 1 else ""
                raise LoRAError(
                    f"{module}: lora_A {a.shape}, lora_B {b.shape} do not fit weight {(out_f, in_f)}{whole}"
                )
            pairs[module] = (local_a, local_b)
        return scale, pairs

    def _load(self, lora_id: int, slot: int) -> None:
        """Write an adapter into `slot` of every bank (zeros for the modules it does not adapt)."""
        name, scale, pairs = self.known[lora_id]
        cols = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        for module, wrapper in self.wrapped.items():
            bank_a, bank_b = wrapper.lora_a.asnumpy().copy(), wrapper.lora_b.asnumpy().copy()
            bank_a[cols], bank_b[:, cols] = 0.0, 0.0
            if module in pairs:
                a, b = pairs[module]
                bank_a[cols][: a.shape[0]] = a
                bank_b[:, cols][:, : b.shape[1]] = b
            ops.assign(wrapper.lora_a, Tensor(bank_a))
            ops.assign(wrapper.lora_b, Tensor(bank_b))
        self.adapters[lora_id] = Adapter(lora_id, name, slot, scale, tuple(pairs))

    def prepare(self, lora_ids) -> None:
        """Give every adapter a batch uses a slot: load the missing ones, evicting the least recently
        used adapters the batch does not use (vLLM schedules at most max_loras adapters a batch)."""
        wanted = sorted({int(i) for i in lora_ids} - {0})
        if len(wanted) > self.max_loras:
            raise LoRAError(f"a batch uses {len(wanted)} adapters {wanted}; max_loras={self.max_loras}")
        unknown = [i for i in wanted if i not in self.known]
        if unknown:
            raise LoRAError(f"adapters {unknown} were never added")
        self._batches += 1
        for lora_id in wanted:
            if lora_id not in self.adapters:
                used = {a.slot for a in self.adapters.values()}
                free = [slot for slot in range(self.max_loras) if slot not in used]
                if free:
                    slot = free[0]
                else:
                    idle = [a for a in self.adapters.values() if a.lora_id not in wanted]
                    victim = min(idle, key=lambda a: a.last_used)
                    del self.adapters[victim.lora_id]
                    slot = victim.slot
                self._load(lora_id, slot)
            self.adapters[lora_id].last_used = self._batches

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter; its slot is reused (and overwritten) by the next one loaded."""
        self.adapters.pop(lora_id, None)
        return self.known.pop(lora_id, None) is not None

    def list(self) -> set[int]:
        return set(self.known)

    def set_batch(self, token_lora_ids: np.ndarray) -> None:
        """token_lora_ids [T]: the adapter of each flat-batch row (0: the base model); rows past T
        (a compiled bucket's padding) get none."""
        t = len(token_lora_ids)
        if t > self.max_tokens:
            raise LoRAError(f"a batch of {t} tokens exceeds the LoRA token capacity {self.max_tokens}")
        self.prepare(np.unique(token_lora_ids))
        mask = np.zeros((self.max_tokens, self.width), np.float32)
        for lora_id in np.unique(token_lora_ids):
            adapter = self.adapters.get(int(lora_id))
            if adapter is None:  # the base model
                continue
            rows = np.flatnonzero(token_lora_ids == lora_id)
            mask[rows, adapter.slot * self.max_rank : (adapter.slot + 1) * self.max_rank] = adapter.scale
        ops.assign(self.mask, Tensor(mask))
