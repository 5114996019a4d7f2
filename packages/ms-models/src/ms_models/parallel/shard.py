"""One rank's shard of an ms-models model: its local config, its communicating cells, its weights.

`build_tp_model(path, plan, group)` reads a checkpoint folder: the model of the *local* config
(heads, MLP widths and, vocab-parallel, the vocabulary divided by tp; under EP the rank's routed
experts only), the communicating cells swapped in (layers.py), and only this rank's slices of the
safetensors, cut by the ms-layout layouts of `model_layouts` (the rest of each tensor is never
read). `shard_model(model, plan, group)` does the same from a model in memory.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import numpy as np

from .layers import DispatchMoE, ParallelMoE, RowParallelLinear, VocabParallelEmbedding, all_reduce
from .plan import ParallelError, ShardPlan

_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_VOCAB = re.compile(r"(embed_tokens|lm_head|shared_head\.head)\.weight$")
#: a quantized layer's companion tensors (W8A8 / W4A16 checkpoints): sliced like the layer's weight
_QUANT = re.compile(r"^(.+)\.(weight_scale|weight_packed|input_scale|weight_shape)$")
_WHOLE = ("input_scale", "weight_shape")


def _companion_slice(layout, kind: str, weight_name: str, shape: tuple[int, ...], rank: int) -> tuple[slice, ...]:
    """The slice of a quantized companion of `weight_name` [out, in] a rank holds: a per-output-channel
    scale [out] follows the weight's rows; packed int4 [out, in / 8] and group scales [out, in / g]
    follow its rows and columns (whole 8-value words and whole groups per rank)."""
    if len(shape) == 1:
        return layout.global_slice((shape[0], layout.splits[1]), rank)[:1]
    try:
        return layout.global_slice(shape, rank)
    except Exception as err:
        raise ParallelError(
            f"{weight_name}'s {kind} {list(shape)} does not split over the ranks like the weight ({err})"
        ) from None


def local_config(config, plan: ShardPlan):
    """The ms-models config of one rank's shard: heads, MLP widths (and the vocabulary) divided by tp."""
    from ..config import DeepseekV3Config, config_from_dict

    plan.check(config.to_dict())
    t, d = plan.tp, config.to_dict()
    d["num_attention_heads"] = config.num_attention_heads // t
    d["num_key_value_heads"] = config.num_key_value_heads // t
    if plan.vocab_parallel:
        d["vocab_size"] = config.vocab_size // t
    d["intermediate_size"] = max(config.intermediate_size // t, 1)
    if not isinstance(config, DeepseekV3Config):
        d["head_dim"] = config.head_dim  # otherwise derived from hidden_size / heads
        return config_from_dict(d)
    if plan.expert_parallel:
        # Only the expert count matters here: ParallelMoE brings the full router back.
        n = config.n_routed_experts // plan.ep
        d.update(n_routed_experts=n, n_group=1, topk_group=1, num_experts_per_tok=min(config.num_experts_per_tok, n))
    else:
        d["moe_intermediate_size"] = config.moe_intermediate_size // t
    return config_from_dict(d)


def shard_cells(model, full_config, plan: ShardPlan, group) -> None:
    """Swap in the cells that communicate (row-parallel linears, MoE and, vocab-parallel, the
    embedding and the logits' all-gather) into a model built from `local_config`."""
    m, c = model.model, full_config
    layers = list(m.layers) + list(getattr(m, "mtp_layers", None) or [])
    if plan.dp > 1:  # DP attention (tp = 1): only the routed experts are split, exchanged by all-to-all
        for layer in layers:
            if hasattr(layer.mlp, "experts"):
                layer.mlp = DispatchMoE(layer.mlp, full_config, plan, group)
        return
    for layer in layers:
        attn = layer.self_attn
        attn.o_proj = RowParallelLinear.like(attn.o_proj, group)
        if hasattr(layer.mlp, "experts"):
            layer.mlp = ParallelMoE(layer.mlp, full_config, plan, group)
        else:
            layer.mlp.down_proj = RowParallelLinear.like(layer.mlp.down_proj, group)
    if not plan.vocab_parallel:
        return
    m.embed_tokens = VocabParallelEmbedding(c.vocab_size // plan.tp, c.hidden_size, plan.rank, group)
    local_logits = model.compute_logits

    def compute_logits(hidden):
        """[..., V/tp] on each rank -> [..., V], ranks' vocabulary slices in rank order."""
        from mindspore import Tensor

        part = np.ascontiguousarray(local_logits(hidden).asnumpy())
        return Tensor.from_numpy(group.all_gather(part, axis=part.ndim - 1))

    model.compute_logits = compute_logits


def shard_tensors(
    tensors: Iterable[tuple[str, tuple[int, ...], Callable]], config, plan: ShardPlan
) -> dict[str, np.ndarray]:
    """This rank's slice of every (checkpoint name, global shape, read(slices)) tensor: `read` gets
    the index of the slice, so a lazy reader reads nothing else. Routed experts are renumbered to the
    rank's local indices; another EP rank's experts are skipped."""
    from ..layouts import model_layouts

    vocab = plan.vocab_parallel
    dense = model_layouts(config, plan.dense_config(), checkpoint=True, vocab_parallel=vocab)
    experts = (
        model_layouts(config, plan.expert_config(), checkpoint=True, vocab_parallel=vocab)
        if plan.expert_parallel
        else dense
    )
    first = plan.expert_range(getattr(config, "n_routed_experts", 0) or 0)[0]
    out: dict[str, np.ndarray] = {}
    for name, shape, read in tensors:
        numbered = _EXPERT.search(name)
        quant = _QUANT.match(name)
        key = f"{quant.group(1)}.weight" if quant else name
        placement = (experts if numbered else dense).get(key)
        if placement is None or (not plan.vocab_parallel and _VOCAB.search(name)):
            out[name] = np.asarray(read(slice(None)))  # replicated, or not ours to place (load reports it)
            continue
        layout = placement.layout
        rank = plan.ep_rank if numbered and plan.expert_parallel else plan.rank
        if rank not in layout.ranks:  # another EP rank's expert
            continue
        if quant and quant.group(2) in _WHOLE:
            index = slice(None)
        elif quant:
            index = _companion_slice(layout, quant.group(2), key, tuple(shape), rank)
        else:
            index = layout.global_slice(tuple(shape), rank)
        value = np.asarray(read(index))
        if numbered and plan.expert_parallel:
            e = int(numbered.group(1)) - first
            name = f"{name[: numbered.start()]}.experts.{e}.{name[numbered.end() :]}"
        # float weights as float32; quantized integers (int8 values, packed int4) kept as they are
        out[name] = value if value.dtype.kind in "iu" else value.astype(np.float32)
    return out


def read_shards(path: str, config, plan: ShardPlan) -> dict[str, np.ndarray]:
    """This rank's slices of a checkpoint folder, read with safetensors' lazy slicing."""
    from safetensors import safe_open

    from ..io import _safetensor_files

    out: dict[str, np.ndarray] = {}
    for file in _safetensor_files(str(path)):
        with safe_open(file, framework="np") as f:
            lazy = {name: f.get_slice(name) for name in f.keys()}
            items = ((n, tuple(s.get_shape()), s.__getitem__) for n, s in lazy.items())
            out.update(shard_tensors(items, config, plan))
    return out


def _sharded(config, plan: ShardPlan, group, tensors: dict[str, np.ndarray]):
    from ..io import from_config, load_state_dict

    model = from_config(local_config(config, plan))
    shard_cells(model, config, plan, group)
    load_state_dict(model, tensors, strict=True)
    return model


def build_tp_model(path: str, plan: ShardPlan, group):
    """The model of this rank's shard of the checkpoint at `path` (inference mode)."""
    from ..config import load_config

    config = load_config(path)
    model = _sharded(config, plan, group, read_shards(path, config, plan))
    model.set_train(False)
    return model


def shard_model(model, plan: ShardPlan, group):
    """This rank's shard of a whole `model` in memory: same class, same (HF) parameter names."""
    from ..io import hf_state_dict

    full = hf_state_dict(model)
    items = ((n, v.shape, v.__getitem__) for n, v in full.items())
    return _sharded(model.config, plan, group, shard_tensors(items, model.config, plan))


__all__ = ["all_reduce", "build_tp_model", "local_config", "read_shards", "shard_cells", "shard_model", "shard_tensors"]
