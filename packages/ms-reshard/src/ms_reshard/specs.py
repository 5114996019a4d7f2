"""Parameter specs of a whole model from Hugging Face names and a ParallelConfig.

The layout of each parameter comes from ``ms_layout.param_placement`` (role from the name, stage
from the layer index, owner from the expert index). Training with optimizer sharding stores each
parameter split further along dim 0 over its replicas (MindSpore's optimizer parallel, ZeRO-3
style storage): ``stored_layout`` adds those axes, the rule of ``ms_layout.optimizer_layout``,
applied to the placed layout so that it also covers numbered experts, and skipped -- as MindSpore
does -- when dim 0 does not divide.

Placements are computed once per representative name -- the same parameter in pipeline stage 0
and, for a numbered expert, owned by expert-parallel rank 0 -- and moved to the real stage and
owner by shifting the ranks: a ParallelConfig's meshes number ranks row-major over all their axes,
so the ranks of stage s are those of stage 0 plus s * stride(pp), in the same order, and likewise
for the ep coordinate. (Each ``param_placement`` call walks every rank of the job in Python, about
60 ms at 1024 ranks, so calling it for each of DeepSeek-V3's 45k parameters is not an option;
tests/test_specs.py checks the shift against direct calls.)
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from ms_layout import Layout, LayoutError, ParallelConfig, layer_stages, param_placement, role_of

from .errors import ReshardError
from .fusion import FusionRule, fuse_shapes
from .model_plan import ParamSpec

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def stored_layout(layout: Layout, shape: Sequence[int]) -> Layout:
    """`layout` with dim 0 also split over its dp/cp/edp replica axes, when dim 0 divides."""
    if not shape:
        return layout
    extra = tuple(a for a in ("dp", "cp", "edp") if a in layout.replica_axes and layout.axis_size(a) > 1)
    if not extra or shape[0] % (layout.splits[0] * math.prod(layout.axis_size(a) for a in extra)):
        return layout
    dims = (layout.dims[0] + extra, *layout.dims[1:])
    return Layout(layout.device_matrix, layout.alias_names, dims, layout.rank_list)


def _strides(mesh: Layout) -> dict[str, int]:
    out, stride = {}, 1
    for name, size in zip(reversed(mesh.alias_names), reversed(mesh.device_matrix)):
        out[name] = stride
        stride *= size
    return out


def _representative(name: str, stages: list[int], num_layers: int, per_owner: int | None) -> tuple[str, int, int]:
    """(the name moved to stage 0 and expert owner 0, its stage, its owner)."""
    stage = owner = 0
    m = _LAYER.search(name)
    if m and int(m.group(2)) < num_layers and 0 in stages:
        stage = stages[int(m.group(2))]
        name = f"{name[: m.start(2)]}{stages.index(0)}{name[m.end(2) :]}"
    e = _EXPERT.search(name)
    if e and per_owner:
        owner = int(e.group(1)) // per_owner
        name = f"{name[: e.start(1)]}{int(e.group(1)) % per_owner}{name[e.end(1) :]}"
    return name, stage, owner


def _kind(rep: str, ndim: int, num_layers: int) -> tuple:
    """What a stage-0 representative's layout depends on: inside a decoder layer only the role, the
    ndim and whether it is a numbered expert (param_placement's rule); elsewhere the name itself."""
    m = _LAYER.search(rep)
    if not m or int(m.group(2)) >= num_layers:
        return (rep, ndim)
    try:
        role = role_of(rep)
    except LayoutError:
        return (rep, ndim)  # param_placement raises the error with the name
    return (role, ndim, bool(_EXPERT.search(rep)))


def _shifted(layout: Layout, shift: int) -> Layout:
    if not shift:
        return layout
    ranks = tuple(r + shift for r in layout.ranks)
    return Layout(layout.device_matrix, layout.alias_names, layout.dims, ranks)


def param_specs(
    shapes: Mapping[str, Sequence[int]],
    config: ParallelConfig,
    num_layers: int,
    num_experts: int | None = None,
    dtype: str = "float32",
    optimizer_sharded: bool | None = None,
    fusions: Sequence[FusionRule] = (),
    layers_per_chunk: Sequence[int] | None = None,
) -> dict[str, ParamSpec]:
    """Specs of HF-named parameters under `config`; `fusions` fuses complete part groups first
    (an inference side with qkv_proj); `optimizer_sharded` defaults to config.optimizer_shard."""
    fused = fuse_shapes(shapes, fusions)
    sharded = config.optimizer_shard if optimizer_sharded is None else optimizer_sharded
    try:
        stages = layer_stages(num_layers, config.pp, config.vpp, layers_per_chunk)
    except LayoutError as exc:
        raise ReshardError(str(exc)) from None
    per_owner = num_experts // config.ep if num_experts and num_experts % config.ep == 0 else None
    pp_stride = _strides(config.mesh)["pp"]
    ep_stride = _strides(config.expert_mesh)["ep"]
    placed: dict[tuple, Layout] = {}
    shifted: dict[tuple[str, int, int, int], Layout] = {}
    stored: dict[tuple[Layout, int], Layout] = {}
    interned: dict[Layout, Layout] = {}
    out = {}
    for name, (shape, parts, part_dim) in fused.items():
        rep, stage, owner = _representative(name, stages, num_layers, per_owner)
        key = (rep, len(shape), stage, owner)
        layout = shifted.get(key)
        if layout is None:
            kind = _kind(rep, len(shape), num_layers)
            base = placed.get(kind)
            if base is None:
                try:
                    base = param_placement(config, rep, len(shape), num_layers, num_experts, layers_per_chunk).layout
                except LayoutError as exc:
                    raise ReshardError(f"parameter {name!r}: {exc}") from None
                placed[kind] = base
            layout = _shifted(base, stage * pp_stride + owner * ep_stride)
            # one object per distinct layout: PlanCache then finds repeats by identity
            layout = shifted[key] = interned.setdefault(layout, layout)
        if sharded and shape:
            skey = (layout, shape[0])
            if skey not in stored:
                stored[skey] = stored_layout(layout, shape)
            layout = stored[skey]
        out[name] = ParamSpec(layout, tuple(shape), dtype, parts, part_dim)
    return out
