"""A small tensor-parallel decoder (Megatron-style TP) built from an ms_models Llama/Qwen2 model.

One TP rank's shard of a decoder layer is itself an ms_models decoder layer with a 1/tp share of the
heads and of the MLP width: q/k/v and gate/up are column-parallel (rows split), o_proj and down_proj
row-parallel (columns split), cut from the full weights with the layouts ``ms_models.model_layouts``
gives under ``ParallelConfig(tp=...)``. ``TPDecoderLayer`` runs that shard between Megatron's two
conjugate operators (Shoeybi et al., arXiv 1909.08053, fig. 3):

    h   = x + g(self_attn(f(input_layernorm(x))))        g: all-reduce forward, identity backward
    out = h + g(mlp(f(post_attention_layernorm(h))))     f: identity forward, all-reduce backward

Its forward is a *program* (``ms_recompute.runtime.checkpoint``): it yields each g all-reduce, so the
recompute can start it asynchronously and compute the other layer of a pair meanwhile. Embedding,
final norm and head stay replicated (no vocab parallelism; this model exists to exercise recompute
under TP, not to be a full TP implementation). Row-parallel biases are refused: each rank would add
the bias before the all-reduce sums the ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from mindspore import Tensor, nn

from ms_layout import Layout, ParallelConfig, shard

from ..errors import RecomputeError
from .checkpoint import AllReduce, Program, run_sync


class CopyToTP(nn.Cell):
    """Megatron's f: identity in the forward; the gradient is all-reduced over the TP group."""

    def __init__(self, group: Any):
        super().__init__()
        self.group = group

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        buf = np.array(dout.asnumpy(), copy=True, order="C")
        self.group.all_reduce(buf)
        return (Tensor.from_numpy(buf),)


class TPDecoderLayer(nn.Cell):
    """This rank's shard of a Llama/Qwen2 decoder layer, with the TP collectives around it."""

    def __init__(self, shard_layer: nn.Cell, group: Any):
        super().__init__()
        self.layer = shard_layer
        self.group = group
        self.copy = CopyToTP(group)

    # the shard's sub-modules under their HF names, so a selective plan addresses them as in ms_models
    input_layernorm = property(lambda self: self.layer.input_layernorm)
    self_attn = property(lambda self: self.layer.self_attn)
    post_attention_layernorm = property(lambda self: self.layer.post_attention_layernorm)
    mlp = property(lambda self: self.layer.mlp)

    def program(self, x, cos, sin, allowed) -> Program:
        """The forward as a program: each ``yield`` hands out a g all-reduce and gets the sum back."""
        layer = self.layer
        attention = layer.self_attn(self.copy(layer.input_layernorm(x)), cos, sin, allowed)
        h = x + (yield AllReduce(attention, self.group))
        mlp = layer.mlp(self.copy(layer.post_attention_layernorm(h)))
        return h + (yield AllReduce(mlp, self.group))

    def construct(self, x, cos, sin, allowed):
        return run_sync(self.program(x, cos, sin, allowed))


def _shard_config(config: Any, tp: int) -> Any:
    if getattr(config, "model_type", None) not in ("llama", "qwen2"):
        raise RecomputeError(
            f"tp_model supports llama and qwen2 configs, got model_type {getattr(config, 'model_type', None)!r}"
        )
    if getattr(config, "o_bias", False) or getattr(config, "mlp_bias", False):
        raise RecomputeError(
            "tp_model cannot shard row-parallel biases (o_proj/down_proj bias): set attention_bias/mlp_bias False"
        )
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise RecomputeError(f"tp={tp} does not divide {bad}")
    return dataclasses.replace(config, **{k: v // tp for k, v in sizes.items()}, head_dim=config.head_dim)


def tp_model(model: Any, group: Any) -> tuple[Any, dict[str, Layout]]:
    """This rank's tensor-parallel copy of an ms_models Llama/Qwen2 ``model`` over ``group`` (its
    ranks 0..tp-1 are the TP ranks). Returns ``(tp_model, layouts)``: the new model (same class, HF
    parameter names) with ``TPDecoderLayer`` layers, and the ``ms_layout.Layout`` of every sharded
    parameter, so ``shard(full_array, layouts[name], group.rank)`` gives this rank's part."""
    import ms_models

    tp = group.size
    placements = ms_models.model_layouts(model, ParallelConfig(tp=tp))
    tp_net = type(model)(_shard_config(model.config, tp))
    full = dict(model.parameters_and_names())
    layouts: dict[str, Layout] = {}
    names: dict[int, str] = {}
    for name, param in tp_net.parameters_and_names():
        value = full[name].asnumpy()
        if name.startswith("model.layers."):  # layers are sharded; embedding, final norm and head replicated
            layouts[name] = placements[name].layout
            value = shard(value, layouts[name], group.rank)
        if tuple(value.shape) != tuple(param.shape):
            raise RecomputeError(f"{name}: shard shape {value.shape} does not fit the TP layer's {tuple(param.shape)}")
        param.set_data(Tensor(np.ascontiguousarray(value)))
        names[id(param)] = name
    layers = tp_net.model.layers
    for i in range(len(layers)):
        layers[i] = TPDecoderLayer(layers[i], group)
    for param in tp_net.get_parameters():  # the wrapper renamed them (cell-path prefixes): restore HF names
        param.name = names[id(param)]
    return tp_net, layouts
