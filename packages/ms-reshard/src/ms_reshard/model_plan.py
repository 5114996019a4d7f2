"""Whole-model plans: every parameter of a model from one set of layouts to another.

Parameters are matched by name; a name one side fuses and the other splits is matched through the
declared fusion rules (fusion.py), one tensor plan per part. Plans are cached twice: exactly, by
(layouts, shape, itemsize) -- every layer of one pipeline stage shares them -- and up to an
order-preserving relabeling of the ranks, which makes the plans of other stages and other expert
owners free (the planner's choices depend only on rank order, see planner._choose_senders).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ms_layout import Layout

from .errors import ReshardError
from .fusion import DEFAULT_FUSIONS, FusionRule, concat_shape, fused_name, part_names, split_name
from .plan import TensorPlan
from .planner import MULTICAST_MIN, _check_inputs, plan_ids

ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int8": 1, "uint8": 1}


def itemsize_of(dtype: str) -> int:
    """Bytes per element of a dtype name (bfloat16 included, which numpy does not know)."""
    if dtype in ITEMSIZE:
        return ITEMSIZE[dtype]
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        raise ReshardError(f"unknown dtype {dtype!r}; known: {sorted(ITEMSIZE)}") from None


@dataclass(frozen=True)
class ParamSpec:
    """One parameter on one side of a reshard."""

    layout: Layout
    """Its layout, with the ranks that hold it."""
    shape: tuple[int, ...]
    """Its global shape."""
    dtype: str = "float32"
    """Its dtype name (the executors cast to the target's dtype on arrival)."""
    parts: tuple[int, ...] = ()
    """For a fused parameter: the size of each part along `part_dim` (each rank holds its shard of
    every part, side by side), so that it can be resharded part by part; () when not fused."""
    part_dim: int = 0
    """The dim the parts of a fused parameter are stacked along."""


@dataclass(frozen=True)
class PartMove:
    """One tensor moved by one plan: a whole parameter, or one part of a fused parameter."""

    src_name: str
    """Source parameter the tensor is read from."""
    dst_name: str
    """Target parameter the tensor is written to."""
    dim: int
    """Dim along which the tensor sits inside a fused parameter (0 when nothing is fused)."""
    src_offset: int
    """Offset along `dim` of the tensor inside every source rank's local shard."""
    dst_offset: int
    """Offset along `dim` of the tensor inside every target rank's local shard."""
    plan: TensorPlan
    """The plan for the tensor itself (its shape is the part's shape)."""


@dataclass(frozen=True, eq=False)
class ModelPlan:
    """How to move every parameter of a model."""

    src: dict[str, ParamSpec]
    """Source parameters by name."""
    dst: dict[str, ParamSpec]
    """Target parameters by name."""
    moves: tuple[PartMove, ...]
    """One move per target parameter, or per part of a fused one, in target name order."""
    unused: tuple[str, ...] = field(default=())
    """Source parameters no target needs (allowed only when asked for)."""

    def per_rank(self) -> dict[int, dict[str, int]]:
        """Per global rank: bytes sent, received and the lower bound, summed over all moves."""
        # Moves that share a plan's arrays (the caches) are added once, times their count.
        groups: dict[tuple[int, ...], list] = {}
        for move in self.moves:
            p = move.plan
            key = (id(p.ranks), id(p.sent), id(p.received), id(p.lower_bound))
            entry = groups.get(key)
            if entry is None:
                groups[key] = [p, 1]
            else:
                entry[1] += 1
        if not groups:
            return {}
        n = max(int(p.ranks.max(initial=-1)) for p, _ in groups.values()) + 1
        acc = np.zeros((3, n), dtype=np.int64)
        touched = np.zeros(n, dtype=bool)
        for p, count in groups.values():
            acc[:, p.ranks] += count * np.stack([p.sent, p.received, p.lower_bound])
            touched[p.ranks] = True
        return {
            int(r): {"sent": int(acc[0, r]), "received": int(acc[1, r]), "lower_bound": int(acc[2, r])}
            for r in np.flatnonzero(touched)
        }

    def bytes_moved(self) -> int:
        """Total bytes received by all ranks."""
        return self._total("received")

    def lower_bound_total(self) -> int:
        """Total of all per-rank lower bounds."""
        return self._total("lower_bound")

    def _total(self, field: str) -> int:
        sums: dict[int, int] = {}  # one sum per array, however many moves share it
        total = 0
        for m in self.moves:
            arr = getattr(m.plan, field)
            s = sums.get(id(arr))
            if s is None:
                s = sums[id(arr)] = int(arr.sum())
            total += s
        return total

    def unique_plans(self) -> int:
        """Distinct plan arrays (plans shared through the caches count once)."""
        return len({id(m.plan.xfer_src) for m in self.moves})

    def __str__(self) -> str:
        lines = [
            f"ModelPlan: {len(self.dst)} target parameters, {len(self.moves)} moves, "
            f"{self.unique_plans()} distinct plans; moved {self.bytes_moved()} B, "
            f"lower bound {self.lower_bound_total()} B"
        ]
        for m in self.moves[:20]:
            part = "" if m.src_name == m.dst_name else f" <- {m.src_name}"
            lines.append(
                f"  {m.dst_name}{part}  {m.plan.shape}  moved {m.plan.bytes_moved()} B "
                f"(lower bound {m.plan.lower_bound_total()} B)"
            )
        if len(self.moves) > 20:
            lines.append(f"  ... {len(self.moves) - 20} more")
        return "\n".join(lines)


@dataclass(frozen=True, eq=False)
class _Seen:
    """What PlanCache keeps per layout object it was given."""

    layout: Layout
    """The object (kept alive, so that its id stays its own)."""
    first: Layout
    """The first object given that equals it: exact keys use its id."""
    form: tuple
    """The layout without its ranks (_form)."""
    ranks: np.ndarray
    """Its ranks, int64, in device-matrix position order."""


class PlanCache:
    """Plans by exact key, and by key up to an order-preserving relabeling of the ranks."""

    def __init__(self, mem_cap: int | None = None, collectives: bool = True, multicast_min: int | None = MULTICAST_MIN):
        self.mem_cap, self.collectives, self.multicast_min = mem_cap, collectives, multicast_min
        self.exact: dict[tuple, TensorPlan] = {}
        self.canonical: dict[tuple, TensorPlan] = {}
        self.computed = 0
        # Whole-model planning asks ~45k times for ~200 plans and ~4k relabelings of them; what
        # makes a repeat cheap is not hashing, comparing or converting 4096-rank layouts again:
        # each layout object is looked at once (_seen), and repeats are found by identity.
        self._seen: dict[int, _Seen] = {}
        self._equal: dict[Layout, Layout] = {}
        self._checked: set[tuple] = set()

    def get(self, src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int) -> TensorPlan:
        """The plan for these layouts and shape, computed at most once per relabeling class."""
        s, d = self._seen.get(id(src)), self._seen.get(id(dst))
        if s is None or s.layout is not src:
            s = self._see(src)
        if d is None or d.layout is not dst:
            d = self._see(dst)
        key = (id(s.first), id(d.first), shape, itemsize)
        found = self.exact.get(key)
        if found is None:
            found = self.exact[key] = self._get(s, d, shape, itemsize)
        return found

    def _see(self, layout: Layout) -> _Seen:
        if not isinstance(layout, Layout) or layout.dims is None:
            _check_inputs(layout, layout, (), 1, None)  # raises the error naming it
        first = self._equal.setdefault(layout, layout)
        seen = self._seen[id(layout)] = _Seen(layout, first, _form(layout), np.asarray(layout.ranks, dtype=np.int64))
        return seen

    def _get(self, s: _Seen, d: _Seen, shape: tuple[int, ...], itemsize: int) -> TensorPlan:
        src, dst = s.first, d.first
        # planner._check_inputs once per (form, form, shape): whether a shape fits depends on the
        # mesh and map, not on the ranks
        if (s.form, d.form, shape, itemsize) not in self._checked:
            _check_inputs(src, dst, shape, itemsize, self.mem_cap)
            self._checked.add((s.form, d.form, shape, itemsize))
        ranks = _union(s.ranks, d.ranks)
        src_ids, dst_ids = np.searchsorted(ranks, s.ranks), np.searchsorted(ranks, d.ranks)
        ckey = (s.form, d.form, shape, itemsize, src_ids.tobytes(), dst_ids.tobytes())
        core = self.canonical.get(ckey)
        if core is None:
            core = plan_ids(
                src, dst, shape, src_ids, dst_ids, ranks, itemsize, self.mem_cap, self.collectives, self.multicast_min
            )
            self.canonical[ckey] = core
            self.computed += 1
        return core if core.src is src and core.dst is dst else core.relabel(src, dst, ranks)


def _union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """np.union1d (sorted distinct values of both) without its generic wrappers."""
    both = np.concatenate((a, b))
    both.sort()
    keep = np.empty(len(both), dtype=bool)
    keep[:1] = True
    np.not_equal(both[1:], both[:-1], out=keep[1:])
    return both[keep]


def _form(layout: Layout) -> tuple:
    """A layout without its ranks: what its shard shapes depend on."""
    return (layout.device_matrix, layout.alias_names, layout.dims)


def _local_size(layout: Layout, part_dim_size: int, dim: int, name: str) -> int:
    parts = layout.splits[dim]
    if part_dim_size % parts:
        raise ReshardError(
            f"a part of {name!r} has {part_dim_size} rows along dim {dim}, not divisible into the {parts} "
            f"chunks of its layout {layout}"
        )
    return part_dim_size // parts


def model_plan(
    src: Mapping[str, ParamSpec],
    dst: Mapping[str, ParamSpec],
    fusions: Sequence[FusionRule] = DEFAULT_FUSIONS,
    mem_cap: int | None = None,
    collectives: bool = True,
    allow_unused: bool = False,
    cache: PlanCache | None = None,
) -> ModelPlan:
    """Plan moving every target parameter from the source parameters (see the module docstring)."""
    cache = cache or PlanCache(mem_cap, collectives)
    moves: list[PartMove] = []
    used: set[str] = set()
    # param_specs gives one ParamSpec object per distinct spec, so a model of 45k names has a few
    # thousand (source spec, target spec) pairs: each pair is planned once (the entry keeps both
    # specs alive, so their ids stay theirs even if a Mapping made them on the fly)
    pairs: dict[tuple[int, int], tuple[ParamSpec, ParamSpec, TensorPlan]] = {}
    for name in sorted(dst):
        spec = dst[name]
        s = src.get(name)
        if s is not None:  # (used: a name on both sides is)
            if not (s.parts or spec.parts):
                found = pairs.get((id(s), id(spec)))
                if found is None:
                    found = pairs[id(s), id(spec)] = (s, spec, _move(cache, name, s, name, spec).plan)
                moves.append(_whole(name, found[2]))
                continue
            moves += _same_name(cache, name, s, spec)
        elif (split := part_names(name, fusions)) and all(p in src for p in split[0]):
            moves += _gather_parts(cache, name, spec, split[0], split[1], src)
            used.update(split[0])
        elif (fused := fused_name(name, fusions)) and fused[0] in src:
            moves.append(_from_fused(cache, name, spec, fused[0], fused[1], fused[2], src, dst))
            used.add(fused[0])
        else:
            raise ReshardError(f"no source for target parameter {name!r}: not in the source, no fusion rule maps it")
    unused = tuple(sorted(n for n in src if n not in dst and n not in used))
    if unused and not allow_unused:
        raise ReshardError(f"{len(unused)} source parameters have no target, e.g. {list(unused[:5])}")
    return ModelPlan(dict(src), dict(dst), tuple(moves), unused)


def _whole(name: str, plan: TensorPlan) -> PartMove:
    """PartMove(name, name, 0, 0, 0, plan), without the frozen dataclass's per-field setattr (a
    model has tens of thousands)."""
    move = object.__new__(PartMove)
    move.__dict__.update(src_name=name, dst_name=name, dim=0, src_offset=0, dst_offset=0, plan=plan)
    return move


def _same_name(cache, name: str, s: ParamSpec, d: ParamSpec) -> list[PartMove]:
    """A parameter with one name on both sides; a fused one moves part by part, because each rank's
    shard interleaves the parts and a plain reshard of the fused tensor would mix them."""
    parts, dim = d.parts or s.parts, d.part_dim if d.parts else s.part_dim
    if not parts:
        return [_move(cache, name, s, name, d)]
    if (s.parts and s.parts != parts) or (s.parts and d.parts and s.part_dim != d.part_dim):
        raise ReshardError(f"fused {name!r} has parts {list(s.parts)} in the source but {list(d.parts)} in the target")
    if tuple(s.shape) != tuple(d.shape) or sum(parts) != d.shape[dim]:
        raise ReshardError(
            f"fused {name!r}: shapes {tuple(s.shape)} -> {tuple(d.shape)} do not fit parts {list(parts)}"
        )
    out, s_off, d_off = [], 0, 0
    for size in parts:
        shape = tuple(size if i == dim else n for i, n in enumerate(d.shape))
        out.append(_move(cache, name, s, name, d, dim, s_off, d_off, shape))
        s_off += _local_size(s.layout, size, dim, name)
        d_off += _local_size(d.layout, size, dim, name)
    return out


def _move(cache, src_name, s: ParamSpec, dst_name, d: ParamSpec, dim=0, s_off=0, d_off=0, shape=None) -> PartMove:
    """A move of `shape` (default: the whole parameter, which must have one shape on both sides)."""
    if shape is None:
        if tuple(s.shape) != tuple(d.shape):
            raise ReshardError(
                f"{dst_name!r} has shape {tuple(s.shape)} in the source and {tuple(d.shape)} in the target"
            )
        shape = tuple(d.shape)
    try:
        p = cache.get(s.layout, d.layout, tuple(shape), itemsize_of(s.dtype))
    except ReshardError as exc:
        raise ReshardError(f"parameter {dst_name!r} (from {src_name!r}): {exc}") from None
    return PartMove(src_name, dst_name, dim, s_off, d_off, p)


def _gather_parts(cache, name, spec: ParamSpec, parts, rule: FusionRule, src) -> list[PartMove]:
    shapes = [tuple(src[p].shape) for p in parts]
    if concat_shape(shapes, rule.dim, name) != tuple(spec.shape):
        raise ReshardError(f"{name!r} has shape {tuple(spec.shape)}; its parts {parts} concatenate to other")
    out, offset = [], 0
    for p, shape in zip(parts, shapes):
        out.append(_move(cache, p, src[p], name, spec, rule.dim, 0, offset, shape))
        offset += _local_size(spec.layout, shape[rule.dim], rule.dim, name)
    return out


def _from_fused(cache, name, spec: ParamSpec, fused: str, rule: FusionRule, index: int, src, dst) -> PartMove:
    # The part's offset inside the fused source shard is the sum of the local sizes of the parts
    # before it, so every part must be a target too: their shapes are what splits the fused tensor.
    siblings = fused_siblings(name, rule)
    fused_shape = tuple(src[fused].shape)
    if src[fused].parts:
        sizes = src[fused].parts
        shapes = [tuple(n if i == rule.dim else m for i, m in enumerate(fused_shape)) for n in sizes]
    else:
        missing = [p for p in siblings if p not in dst]
        if missing:
            raise ReshardError(f"{fused!r} is fused from {siblings}; the target lacks {missing}, so it cannot be split")
        shapes = [tuple(dst[p].shape) for p in siblings]
    if concat_shape(shapes, rule.dim, fused) != tuple(src[fused].shape):
        raise ReshardError(f"{fused!r} has shape {tuple(src[fused].shape)}; its target parts {siblings} do not add up")
    layout = src[fused].layout
    offset = sum(_local_size(layout, shape[rule.dim], rule.dim, fused) for shape in shapes[:index])
    return _move(cache, fused, src[fused], name, spec, rule.dim, offset, 0, shapes[index])


def fused_siblings(name: str, rule: FusionRule) -> list[str]:
    """All part names of the fused parameter that part `name` belongs to, in order."""
    prefix, _, leaf = split_name(name)
    return [f"{prefix}{p}.{leaf}" for p in rule.parts]
