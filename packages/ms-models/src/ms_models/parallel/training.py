"""A tensor-parallel shard that trains: Megatron's f and g around each sublayer, in PyNative.

`training_shard(model, group)` cuts this rank's shard of a dense (Llama / Qwen2) model like
`shard_model` does for serving, then makes its collectives differentiable (Shoeybi et al.,
arXiv 1909.08053, fig. 3):

    h   = x + g(self_attn(f(input_layernorm(x))))     f: identity forward, all-reduce backward
    out = h + g(mlp(f(post_attention_layernorm(h))))  g: all-reduce forward, identity backward

f rides on the norms (`CopiedRMSNorm`: the norm, then CopyToTP), g is the row-parallel linears'
all-reduce in `grad_through` mode. The embedding, the final norm and the head stay whole on every
rank (no vocabulary split): every replicated parameter then gets the same gradient on every rank,
and only the sharded ones differ. `training_layouts` gives the ms-layout Layout of every parameter
of that shard, for ms-reshard plans between it and any other layout.

The collectives run on the host, so a step with them is not one compiled graph; ms-recompute's
compiled TP stack (jit segments between asynchronous collectives) is the compiled route.
"""

from __future__ import annotations

from ms_layout import Layout, ParallelConfig

from ..layers import RMSNorm
from .layers import CopyToTP, RowParallelLinear
from .plan import ParallelError, ShardPlan


class CopiedRMSNorm(RMSNorm):
    """An RMSNorm followed by Megatron's f; holds the original norm's weight (same parameter name)."""

    def __init__(self, norm: RMSNorm, group):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = norm.weight
        self.copy = CopyToTP(group)

    def construct(self, x):
        return self.copy(super().construct(x))


def training_shard(model, group):
    """This rank's trainable TP shard of a dense ms-models `model` over `group` (ranks 0..tp-1):
    same class and parameter names, 1/tp of the heads and of the MLP width per rank."""
    from .shard import shard_model

    if getattr(model.config, "model_type", None) not in ("llama", "qwen2"):
        raise ParallelError(f"training_shard takes llama and qwen2 models, got {model.config.model_type!r}")
    net = shard_model(model, ShardPlan(group.size, group.rank, vocab_parallel=False), group)
    for layer in net.model.layers:
        layer.input_layernorm = CopiedRMSNorm(layer.input_layernorm, group)
        layer.post_attention_layernorm = CopiedRMSNorm(layer.post_attention_layernorm, group)
        for cell in (layer.self_attn.o_proj, layer.mlp.down_proj):
            if not isinstance(cell, RowParallelLinear):
                raise ParallelError(f"expected a row-parallel o_proj/down_proj, got {type(cell).__name__}")
            cell.grad_through = True
    for name, param in net.parameters_and_names():  # swapped-in cells named theirs short ("o_proj.weight")
        param.name = name
    return net


def training_layouts(config, parallel: ParallelConfig) -> dict[str, Layout]:
    """{parameter name: Layout} of `training_shard`'s model under `parallel` (its tp and dp): the
    layers' weights split as ``model_layouts`` splits them, the embedding and the head whole."""
    from ..layouts import model_layouts

    return {name: p.layout for name, p in model_layouts(config, parallel, vocab_parallel=False).items()}


__all__ = ["CopiedRMSNorm", "training_layouts", "training_shard"]
