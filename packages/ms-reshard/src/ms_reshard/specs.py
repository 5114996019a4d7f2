"""Parameter specs of a whole model from Hugging Face names and a ParallelConfig.

The layout of each parameter comes from ``ms_layout.param_placement`` (role from the name, stage
from the layer index, owner from the expert index). Training with optimizer sharding stores each
parameter split further along dim 0 over its replicas (MindSpore's optimizer parallel, ZeRO-3
style storage): ``stored_layout`` adds those axes, the rule of ``ms_layout.optimizer_layout``,
applied to the placed layout so that it also covers numbered experts, and skipped -- as MindSpore
does -- when dim 0 does not divide.

The work is proportional to the parameters' distinct kinds, not to ranks x parameters. A name is
parsed once into a template (its layer and expert numbers taken out), its stage and its expert
owner. Per template, one representative -- the same parameter in the first layer of pipeline stage
0 and expert 0 -- gives the kind (role, ndim, numbered expert: all param_placement's rule looks at
inside a decoder layer, MTP layers included), and ``param_placement`` is called once per kind. The
layout of every (kind, stage, owner) is that placement with its ranks shifted: a ParallelConfig's
meshes number ranks row-major over all their axes, so the ranks of stage s are those of stage 0
plus s * stride(pp), in the same order, and likewise for the ep coordinate (tests/test_specs.py
checks the shift against direct calls). Equal specs are one object, so PlanCache finds repeats by
identity.
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


def _shifted(layout: Layout, shift: int) -> Layout:
    if not shift:
        return layout
    ranks = tuple(r + shift for r in layout.ranks)
    return Layout(layout.device_matrix, layout.alias_names, layout.dims, ranks)


class _Placer:
    """The layouts of one config, computed once per kind and shifted per (stage, owner)."""

    def __init__(self, config: ParallelConfig, num_layers: int, num_experts, layers_per_chunk) -> None:
        self.config, self.num_layers, self.num_experts = config, num_layers, num_experts
        self.layers_per_chunk = layers_per_chunk
        try:
            self.stages = layer_stages(num_layers, config.pp, config.vpp, layers_per_chunk)
        except LayoutError as exc:
            raise ReshardError(str(exc)) from None
        # the layer a representative is moved to; None when stage 0 holds no decoder layer
        self.stage0_layer = self.stages.index(0) if 0 in self.stages else None
        divides = num_experts and num_experts % config.ep == 0
        self.per_owner = num_experts // config.ep if divides else None
        self.pp_stride = _strides(config.mesh)["pp"]
        self.ep_stride = _strides(config.expert_mesh)["ep"]
        self.kinds: dict[tuple, int] = {}  # kind -> a small int naming it
        self.templates: dict[tuple[str, int], int] = {}  # (template, ndim) -> kind
        self.placed: list[Layout] = []  # per kind, its layout at stage 0, owner 0
        self.layouts: dict[tuple[int, int, int], Layout] = {}  # (kind, stage, owner) -> layout
        self.interned: dict[Layout, Layout] = {}  # one object per distinct layout
        self.experts: dict[tuple[str, str, int], tuple[int, int]] = {}  # (head, tail, ndim) -> kind, stage

    def layout(self, name: str, ndim: int) -> Layout:
        """The layout param_placement gives `name`, from the caches."""
        if self.per_owner:
            # Most names of a MoE model are numbered experts: "<head>.experts.<e>.<tail>". All but
            # the owner depends on (head, tail) alone -- the number is the first match of _EXPERT,
            # and no other pattern can reach into it -- so those are parsed once per (head, tail).
            head, _, rest = name.partition(".experts.")
            number, dot, tail = rest.partition(".")
            if dot and number.isdecimal():  # \d is a decimal digit, as isdecimal
                key = (head, tail, ndim)
                found = self.experts.get(key)
                if found is None:
                    found = self.experts[key] = self._parse(name, ndim)[:2]
                expert = int(number)
                if expert < self.num_experts:  # (else _owner raises)
                    layout = self.layouts.get((found[0], found[1], expert // self.per_owner))
                    if layout is not None:
                        return layout
                return self._at(found[0], found[1], self._owner(expert))
        return self._at(*self._parse(name, ndim))

    def _owner(self, expert: int) -> int:
        if expert >= self.num_experts:
            raise ReshardError(f"expert {expert} is outside the model's {self.num_experts} experts")
        return expert // self.per_owner

    def _parse(self, name: str, ndim: int) -> tuple[int, int, int]:
        """(kind, stage, owner) of a name."""
        layer = _LAYER.search(name) if "layers." in name else None
        expert = _EXPERT.search(name) if ".experts." in name else None
        stage = owner = 0
        rep_layer = rep_expert = None
        if layer is not None and self.stage0_layer is not None:
            index = int(layer.group(2))
            # MTP layers are numbered after the decoder layers and sit on the last stage (param_placement)
            stage = self.stages[index] if index < self.num_layers else self.config.pp - 1
            rep_layer = layer.span(2)
        if expert is not None and self.per_owner:
            owner = self._owner(int(expert.group(1)))
            rep_expert = expert.span(1)
        numbered = rep_layer is not None or rep_expert is not None
        key = (_replace(name, rep_layer, rep_expert, "#", "#") if numbered else name, ndim)
        kind = self.templates.get(key)
        if kind is None:
            rep = _replace(name, rep_layer, rep_expert, str(self.stage0_layer), "0") if numbered else name
            kind = self.templates[key] = self._kind(rep, ndim, rep_layer is not None)
        return kind, stage, owner

    def _kind(self, rep: str, ndim: int, in_layer: bool) -> int:
        """The kind of a representative (a stage 0 / owner 0 name), placing it once per kind: inside
        a decoder layer only the role, the ndim and whether it is a numbered expert matter
        (param_placement's rule); elsewhere the name itself."""
        kind: tuple = (rep, ndim)
        if in_layer:
            try:
                kind = (role_of(rep), ndim, bool(_EXPERT.search(rep)))
            except LayoutError:
                pass  # param_placement raises the error with the name
        if kind not in self.kinds:
            try:
                c = self.config
                placed = param_placement(c, rep, ndim, self.num_layers, self.num_experts, self.layers_per_chunk)
            except LayoutError as exc:
                raise ReshardError(str(exc)) from None
            self.kinds[kind] = len(self.placed)
            self.placed.append(placed.layout)
        return self.kinds[kind]

    def _at(self, kind: int, stage: int, owner: int) -> Layout:
        """The layout of a kind on a stage and expert owner: the placement's ranks shifted."""
        key = (kind, stage, owner)
        found = self.layouts.get(key)
        if found is None:
            found = _shifted(self.placed[kind], stage * self.pp_stride + owner * self.ep_stride)
            found = self.layouts[key] = self.interned.setdefault(found, found)
        return found


def _replace(name: str, layer, expert, layer_text: str, expert_text: str) -> str:
    """`name` with the layer-number span and the expert-number span (either may be None) replaced."""
    if layer is None:
        return f"{name[: expert[0]]}{expert_text}{name[expert[1] :]}"
    if expert is None:
        return f"{name[: layer[0]]}{layer_text}{name[layer[1] :]}"
    (a, b, text_a), (c, d, text_b) = sorted(((*layer, layer_text), (*expert, expert_text)))
    return f"{name[:a]}{text_a}{name[b:c]}{text_b}{name[d:]}"


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
    placer = _Placer(config, num_layers, num_experts, layers_per_chunk)
    stored: dict[tuple[int, int], Layout] = {}
    specs: dict[tuple, ParamSpec] = {}  # one ParamSpec per distinct (layout, shape, parts)
    out = {}
    for name, (shape, parts, part_dim) in fused.items():
        try:
            layout = placer.layout(name, len(shape))
        except ReshardError as exc:
            raise ReshardError(f"parameter {name!r}: {exc}") from None
        key = (id(layout), shape, parts, part_dim)  # placer keeps the layouts alive
        spec = specs.get(key)
        if spec is None:
            if sharded and shape:  # one stored layout object per (layout, dim 0), as for the layouts
                skey = (id(layout), shape[0])
                if skey not in stored:
                    stored[skey] = stored_layout(layout, shape)
                layout = stored[skey]
            spec = specs[key] = ParamSpec(layout, tuple(shape), dtype, parts, part_dim)
        out[name] = spec
    return out
