"""The layout of each standard decoder weight under a ParallelConfig.

Weights are stored as Hugging Face / MindSpore linears do, ``[out_features, in_features]``:
column-parallel linears (q/k/v, gate/up) split dim 0 over tp, row-parallel ones (o, down) split
dim 1, the vocab-parallel embedding and lm head split the vocabulary (dim 0), norms and the router
are replicated, stacked experts ``[E, out, in]`` split dim 0 over ep. A weight lives on the ranks
of its pipeline stage only: its layout is over that stage's mesh, with the stage's ranks as the
layout's rank_list. With optimizer sharding the optimizer state of a weight is further split
along dim 0 over the dp and cp replicas (ZeRO-1 / MindSpore's optimizer parallel).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cache

from .errors import LayoutError
from .layout import Layout
from .parallel_config import ParallelConfig


class Role(str, Enum):
    """How a kind of weight is split by tensor and expert parallelism."""

    VOCAB = "vocab"
    COLUMN = "column"
    ROW = "row"
    REPLICATED = "replicated"
    EXPERT_COLUMN = "expert_column"
    EXPERT_ROW = "expert_row"


# Per role and weight ndim: the axes of each dim (outermost first). Row-parallel biases are
# added after the reduction, so they are replicated.
_SPECS: dict[tuple[Role, int], tuple[tuple[str, ...], ...]] = {
    (Role.VOCAB, 2): (("tp",), ()),
    (Role.COLUMN, 1): (("tp",),),
    (Role.COLUMN, 2): (("tp",), ()),
    (Role.ROW, 1): ((),),
    (Role.ROW, 2): ((), ("tp",)),
    (Role.EXPERT_COLUMN, 2): (("ep",), ()),
    (Role.EXPERT_COLUMN, 3): (("ep",), ("tp",), ()),
    (Role.EXPERT_ROW, 3): (("ep",), (), ("tp",)),
}

# Hugging Face parameter names of the Llama/Qwen2 and DeepSeek-V3 families, first match wins.
# DeepSeek's q_a_proj and kv_a_proj_with_mqa produce the small shared latent: replicated, as in
# Megatron and MindSpore Transformers. A numbered expert (experts.7.gate_proj) is a whole matrix
# owned by one ep rank; it is matched before the dense patterns.
NAME_ROLES: tuple[tuple[str, Role], ...] = (
    (r"(^|\.)(embed_tokens|lm_head|shared_head\.head)\.weight$", Role.VOCAB),
    (r"\.experts\.(gate_up_proj|gate_proj|up_proj|w1|w3)(\.weight)?$", Role.EXPERT_COLUMN),
    (r"\.experts\.(down_proj|w2)(\.weight)?$", Role.EXPERT_ROW),
    (r"\.(q_a_proj|kv_a_proj_with_mqa|gate|eh_proj)\.weight$", Role.REPLICATED),
    (
        r"\.(q_proj|k_proj|v_proj|qkv_proj|q_b_proj|kv_b_proj|gate_proj|up_proj|gate_up_proj)\.(weight|bias)$",
        Role.COLUMN,
    ),
    (r"\.(o_proj|down_proj)\.(weight|bias)$", Role.ROW),
    (r"(norm|layernorm)\.weight$|\.e_score_correction_bias$|(^|\.)(enorm|hnorm)\.weight$", Role.REPLICATED),
)
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")
_LAYER_INDEX = re.compile(r"(^|\.)layers\.(\d+)\.")


def role_of(name: str) -> Role:
    """The role of a Hugging Face style parameter name; unknown names are a LayoutError."""
    for pattern, role in NAME_ROLES:
        if re.search(pattern, name):
            return role
    raise LayoutError(f"no layout rule for parameter {name!r}; give its Role explicitly")


def weight_layout(config: ParallelConfig, role: Role | str, ndim: int = 2, stage: int = 0) -> Layout:
    """Layout of a weight with `role` and `ndim` dims living in pipeline `stage`."""
    role = _role(role)
    if role is Role.REPLICATED:
        dims: tuple[tuple[str, ...], ...] = ((),) * ndim
    else:
        try:
            dims = _SPECS[(role, ndim)]
        except KeyError:
            known = sorted(n for r, n in _SPECS if r is role)
            raise LayoutError(f"a {role.value} weight has {known} dims, not ndim={ndim}") from None
    experts = role in (Role.EXPERT_COLUMN, Role.EXPERT_ROW)
    mesh = config.stage_mesh(stage, experts=experts)
    return Layout(mesh.device_matrix, mesh.alias_names, dims, mesh.rank_list)


def optimizer_layout(config: ParallelConfig, role: Role | str, ndim: int = 2, stage: int = 0) -> Layout:
    """Layout of the optimizer state of a weight: the weight's, plus dim 0 over the replicas."""
    layout = weight_layout(config, role, ndim, stage)
    if not config.optimizer_shard:
        return layout
    # The replicas of a dense weight are the dp and cp ranks, of an expert the edp ranks.
    extra = tuple(a for a in ("dp", "cp", "edp") if a in layout.replica_axes and layout.axis_size(a) > 1)
    dims = (layout.dims[0] + extra,) + layout.dims[1:]
    return Layout(layout.device_matrix, layout.alias_names, dims, layout.rank_list)


@dataclass(frozen=True)
class ParamPlacement:
    """Where one named parameter lives and how it is split."""

    name: str
    """The parameter name."""
    role: Role
    """How tensor/expert parallelism split it."""
    stage: int
    """The pipeline stage holding it."""
    layout: Layout
    """Its layout (over the stage's ranks, or the owning ep ranks for a numbered expert)."""


def layer_stages(num_layers: int, pp: int, vpp: int = 1, layers_per_chunk: Sequence[int] | None = None) -> list[int]:
    """The pipeline stage of every layer; chunk c of pp*vpp chunks sits on stage c % pp.

    `layers_per_chunk` gives uneven placements (for example fewer layers on the stage that also
    holds the embedding); by default layers are spread evenly and the split must be exact.
    """
    chunks = pp * vpp
    if layers_per_chunk is None:
        if num_layers % chunks:
            raise LayoutError(
                f"{num_layers} layers do not split evenly into pp*vpp={chunks} chunks; give layers_per_chunk"
            )
        layers_per_chunk = [num_layers // chunks] * chunks
    counts = list(layers_per_chunk)
    if len(counts) != chunks or sum(counts) != num_layers or min(counts) < 0:
        raise LayoutError(f"layers_per_chunk {counts} must be {chunks} non-negative counts summing to {num_layers}")
    return [c % pp for c, n in enumerate(counts) for _ in range(n)]


def param_placement(
    config: ParallelConfig,
    name: str,
    ndim: int,
    num_layers: int,
    num_experts: int | None = None,
    layers_per_chunk: Sequence[int] | None = None,
) -> ParamPlacement:
    """Role, stage and layout of a Hugging Face style parameter (`model.layers.3.mlp.up_proj.weight`)."""
    numbered = _EXPERT_INDEX.search(name)
    if numbered:  # experts.7.gate_proj: one expert's matrix, split like a dense linear
        stacked = role_of(name[: numbered.start()] + ".experts." + name[numbered.end() :])
        role = Role.COLUMN if stacked is Role.EXPERT_COLUMN else Role.ROW
    else:
        role = role_of(name)
    layer = _LAYER_INDEX.search(name)
    if layer:
        index = int(layer.group(2))
        stages = layer_stages(num_layers, config.pp, config.vpp, layers_per_chunk)
        # MTP layers are numbered after the decoder layers; they sit with the head, on the last stage.
        stage = stages[index] if index < num_layers else config.pp - 1
    elif re.search(r"(^|\.)(lm_head|norm)\.weight$", name):
        stage = config.pp - 1
    else:
        stage = 0
    layout = weight_layout(config, role, ndim, stage)
    if numbered:
        layout = _owned_by_expert_rank(config, layout, int(numbered.group(1)), num_experts, stage, name)
    return ParamPlacement(name, role, stage, layout)


def _owned_by_expert_rank(
    config: ParallelConfig, layout: Layout, expert: int, num_experts: int | None, stage: int, name: str
) -> Layout:
    # A numbered expert is a whole matrix on the ranks whose ep coordinate owns it: express that
    # as a layout over (edp, tp) restricted to those ranks through rank_list.
    if num_experts is None or num_experts % config.ep or not 0 <= expert < num_experts:
        raise LayoutError(
            f"{name!r} is expert {expert}; num_experts={num_experts!r} must be given, divisible by ep={config.ep}"
        )
    sizes, names, ranks = _expert_owner_mesh(config, stage, expert // (num_experts // config.ep))
    return Layout(sizes, names, layout.dims, ranks)


@cache
def _expert_owner_mesh(config: ParallelConfig, stage: int, owner: int) -> tuple[tuple, tuple, tuple]:
    mesh = config.stage_mesh(stage, experts=True)
    names = tuple(a for a in mesh.alias_names if a != "ep")
    ranks = mesh.ranks_where("ep", owner)
    return tuple(mesh.axis_size(a) for a in names), names, ranks


def _role(role: Role | str) -> Role:
    try:
        return Role(role)
    except ValueError:
        raise LayoutError(f"unknown role {role!r}; expected one of {[r.value for r in Role]}") from None
