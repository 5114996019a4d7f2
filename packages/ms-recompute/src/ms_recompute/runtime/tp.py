"""A small tensor-parallel decoder (Megatron-style TP) built from an ms_models Llama/Qwen2 model.

One TP rank's shard is cut by ``ms_models.parallel`` (the TP layers ms-vllm serves with): each
decoder layer keeps a 1/tp share of the heads and of the MLP width, q/k/v and gate/up column-parallel,
o_proj and down_proj ``RowParallelLinear`` in ``defer`` mode (they return their partial sums).
``TPDecoderLayer`` runs that shard between Megatron's two conjugate operators (Shoeybi et al.,
arXiv 1909.08053, fig. 3):

    h   = x + g(self_attn(f(input_layernorm(x))))        g: all-reduce forward, identity backward
    out = h + g(mlp(f(post_attention_layernorm(h))))     f: identity forward, all-reduce backward

Its forward is a *program* (``ms_recompute.runtime.checkpoint``): it yields each g all-reduce, so the
recompute can start it asynchronously and compute the other layer of a pair meanwhile. Embedding,
final norm and head stay whole on every rank (``vocab_parallel=False``). Row-parallel biases are
refused: the explicit passes add a bias before the all-reduce, so each rank would add it once.
"""

from __future__ import annotations

from typing import Any

from mindspore import nn

from ms_layout import Layout, ParallelConfig
from ms_models.parallel import CopyToTP, ParallelError, ShardPlan, defer_collectives, shard_model

from ..errors import RecomputeError
from .checkpoint import AllReduce, Program, run_sync


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


def _check_config(config: Any, tp: int) -> None:
    if getattr(config, "model_type", None) not in ("llama", "qwen2"):
        raise RecomputeError(
            f"tp_model supports llama and qwen2 configs, got model_type {getattr(config, 'model_type', None)!r}"
        )
    if getattr(config, "o_bias", False) or getattr(config, "mlp_bias", False):
        raise RecomputeError(
            "tp_model cannot shard row-parallel biases (o_proj/down_proj bias): set attention_bias/mlp_bias False"
        )
    try:
        ShardPlan(tp, 0, vocab_parallel=False).check(config.to_dict())
    except ParallelError as e:
        raise RecomputeError(f"tp_model: {e}") from None


def tp_model(model: Any, group: Any) -> tuple[Any, dict[str, Layout]]:
    """This rank's tensor-parallel copy of an ms_models Llama/Qwen2 ``model`` over ``group`` (its
    ranks 0..tp-1 are the TP ranks). Returns ``(tp_model, layouts)``: the new model (same class, HF
    parameter names) with ``TPDecoderLayer`` layers, and the ``ms_layout.Layout`` of every sharded
    parameter, so ``shard(full_array, layouts[name], group.rank)`` gives this rank's part."""
    import ms_models

    tp = group.size
    _check_config(model.config, tp)
    placements = ms_models.model_layouts(model, ParallelConfig(tp=tp))
    # layers are sharded; embedding, final norm and head stay whole
    layouts = {name: p.layout for name, p in placements.items() if name.startswith("model.layers.")}
    tp_net = shard_model(model, ShardPlan(tp, group.rank, vocab_parallel=False), group)
    defer_collectives(tp_net)  # o_proj / down_proj return partial sums: TPDecoderLayer yields the all-reduce
    names = {id(param): name for name, param in tp_net.parameters_and_names()}
    layers = tp_net.model.layers
    for i in range(len(layers)):
        layers[i] = TPDecoderLayer(layers[i], group)
    for param in tp_net.get_parameters():  # the wrapper renamed them (cell-path prefixes): restore HF names
        param.name = names[id(param)]
    return tp_net, layouts
