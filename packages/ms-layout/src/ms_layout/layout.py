"""Tensor layouts: a device matrix of named mesh axes and a tensor map, as in mindspore.parallel.Layout.

A rank's position in the device matrix is row-major (the last axis varies fastest), and a tensor
dim split over several axes uses the first-named axis as the most significant part of the chunk
index. This is MindSpore's convention: ``Layout((2, 2, 2), ("dp", "sp", "mp"))("mp", ("sp", "dp"))``
puts the column chunks 0..3 of the first row block on ranks 0, 4, 2, 6.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Union

from .errors import LayoutError
from .limits import Limit

MAX_RANKS = Limit("MS_LAYOUT_MAX_WORLD_SIZE", 1 << 16, "ranks")
"""Ranks of one mesh or config: rank tables, groups and shard lists are built per rank, so a size read
from a blob or a flag (dp = 10**9) is refused before anything is built."""
MAX_DIMS = Limit("MS_LAYOUT_MAX_DIMS", 64, "dims")
"""Mesh axes of a device matrix and dims of a tensor map or a global shape (numpy allows 64)."""

NONE = "None"
"""The tensor-map entry for a dim that is not split (MindSpore spells it as the string "None")."""

DimSpec = Union[str, Sequence[str]]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_sizes(device_matrix: Sequence[int]) -> tuple[int, ...]:
    if isinstance(device_matrix, (str, bytes)) or not isinstance(device_matrix, Sequence):
        raise LayoutError(f"device_matrix {device_matrix!r:.100} is not a sequence of sizes")
    MAX_DIMS.check(len(device_matrix), "device_matrix axes", LayoutError)
    sizes = tuple(device_matrix)
    if not sizes:
        raise LayoutError("device_matrix is empty; expected at least one mesh axis")
    for size in sizes:
        if not _is_int(size) or size <= 0:
            raise LayoutError(f"device_matrix {sizes!r:.200} has size {size!r:.50}; sizes must be positive ints")
    MAX_RANKS.check(math.prod(sizes), f"device_matrix {sizes} product", LayoutError)
    return sizes


@dataclass(frozen=True)
class Layout:
    """A device matrix with named axes and, once called with per-dim specs, a tensor map."""

    device_matrix: tuple[int, ...]
    """Size of each mesh axis; rank positions are row-major over it (last axis fastest)."""
    alias_names: tuple[str, ...]
    """Name of each mesh axis, e.g. ("dp", "sp", "mp")."""
    dims: tuple[tuple[str, ...], ...] | None = None
    """Per tensor dim, the mesh axes it is split over (most significant first); () = not split."""
    rank_list: tuple[int, ...] | None = None
    """Global rank of each device-matrix position; None means positions 0..N-1 are the ranks."""

    def __post_init__(self) -> None:
        sizes = _check_sizes(self.device_matrix)
        if isinstance(self.alias_names, (str, bytes)) or not isinstance(self.alias_names, Sequence):
            raise LayoutError(f"alias_names {self.alias_names!r:.100} is not a sequence of names")
        names = tuple(self.alias_names)
        object.__setattr__(self, "device_matrix", sizes)
        object.__setattr__(self, "alias_names", names)
        if len(names) != len(sizes):
            raise LayoutError(
                f"alias_names {names} has {len(names)} names for device_matrix {sizes} with {len(sizes)} axes"
            )
        for name in names:
            if not isinstance(name, str) or not name or name == NONE:
                raise LayoutError(f"alias name {name!r} in {names} must be a non-empty str, not 'None'")
            if name == "interleaved_parallel":
                raise LayoutError("alias 'interleaved_parallel' (virtual micro-interleaving) is not supported")
        if len(set(names)) != len(names):
            raise LayoutError(f"alias_names {names} repeats a name; each mesh axis needs its own")
        if self.rank_list is not None:
            if isinstance(self.rank_list, (str, bytes)) or not isinstance(self.rank_list, Sequence):
                raise LayoutError(f"rank_list {self.rank_list!r:.100} is not a sequence of ranks")
            ranks = tuple(self.rank_list)
            bad = [r for r in ranks if isinstance(r, bool) or not hasattr(r, "__index__")]  # numpy ints are fine
            if bad:
                raise LayoutError(f"rank_list holds {bad[0]!r:.50}; ranks must be ints")
            ranks = tuple(operator.index(r) for r in ranks)
            if len(ranks) != self.rank_count or len(set(ranks)) != len(ranks) or min(ranks) < 0:
                raise LayoutError(
                    f"rank_list {list(ranks)!r:.200} must hold {self.rank_count} distinct non-negative ranks "
                    f"for device_matrix {sizes}"
                )
            object.__setattr__(self, "rank_list", ranks)
        if self.dims is not None:
            object.__setattr__(self, "dims", self._check_dims(self.dims))

    def _check_dims(self, dims: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
        if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence):
            raise LayoutError(f"dims {dims!r:.100} is not a sequence of tensor dims")
        MAX_DIMS.check(len(dims), "tensor map dims", LayoutError)
        seen: set[str] = set()
        out = []
        for dim in dims:
            if isinstance(dim, (str, bytes)) or not isinstance(dim, Sequence):
                raise LayoutError(f"tensor dim {dim!r:.100} is not a sequence of mesh axes")
            axes = tuple(dim)
            for axis in axes:
                if not isinstance(axis, str) or axis not in self.alias_names:
                    raise LayoutError(f"unknown alias {axis!r:.50}; the mesh axes are {self.alias_names}")
                if axis in seen:
                    raise LayoutError(f"alias {axis!r} is used on two tensor dims; each axis splits one dim")
                seen.add(axis)
            out.append(axes)
        return tuple(out)

    # ---------------------------------------------------------------- construction
    def __call__(self, *specs: DimSpec) -> Layout:
        """Return this mesh with a tensor map: one spec per tensor dim (alias, tuple, or "None")."""
        dims = []
        for spec in specs:
            items = (spec,) if isinstance(spec, str) else tuple(spec)
            dims.append(tuple(item for item in items if item != NONE))
        return Layout(self.device_matrix, self.alias_names, tuple(dims), self.rank_list)

    @property
    def rank_count(self) -> int:
        """Number of devices in the mesh."""
        return math.prod(self.device_matrix)

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks in device-matrix position order."""
        return self.rank_list if self.rank_list is not None else tuple(range(self.rank_count))

    @cached_property
    def _positions(self) -> dict[int, int]:
        # rank -> position, built once: planners call position() for every rank of every weight
        return {rank: pos for pos, rank in enumerate(self.ranks)}

    @property
    def ndim(self) -> int:
        """Number of tensor dims the layout describes."""
        return len(self._dims())

    def _dims(self) -> tuple[tuple[str, ...], ...]:
        if self.dims is None:
            raise LayoutError(
                f"layout over mesh {self.alias_names} has no tensor map yet; call it with one spec per dim"
            )
        return self.dims

    @property
    def tensor_map(self) -> tuple[int | tuple[int, ...], ...]:
        """MindSpore's tensor map: axis indices counted from the last mesh axis, -1 for no split."""
        out: list[int | tuple[int, ...]] = []
        for axes in self._dims():
            idx = tuple(len(self.alias_names) - 1 - self.alias_names.index(a) for a in axes)
            out.append(-1 if not idx else idx[0] if len(idx) == 1 else idx)
        return tuple(out)

    @classmethod
    def from_tensor_map(
        cls,
        device_matrix: Sequence[int],
        tensor_map: Sequence[int | Sequence[int]],
        alias_names: Sequence[str] | None = None,
        rank_list: Sequence[int] | None = None,
    ) -> Layout:
        """Build from MindSpore's numeric tensor map (indices from the last mesh axis, -1 = none)."""
        sizes = _check_sizes(device_matrix)
        names = tuple(alias_names) if alias_names is not None else tuple(f"d{i}" for i in range(len(sizes)))
        dims = []
        MAX_DIMS.check(len(tensor_map), "tensor map dims", LayoutError)
        for entry in tensor_map:
            items = (entry,) if isinstance(entry, int) else tuple(entry)
            axes = []
            for idx in items:
                if not _is_int(idx) or not -1 <= idx < len(sizes):
                    raise LayoutError(
                        f"tensor_map entry {idx!r} in {tuple(tensor_map)} is out of range for device_matrix {sizes}"
                    )
                if idx == -1:
                    continue
                axes.append(names[len(sizes) - 1 - idx])
            dims.append(tuple(axes))
        return cls(sizes, names, tuple(dims), tuple(rank_list) if rank_list is not None else None)

    # ---------------------------------------------------------------- rank math
    def axis_size(self, alias: str) -> int:
        """Size of one mesh axis."""
        return self.device_matrix[self._axis_index(alias)]

    def _axis_index(self, alias: str) -> int:
        if alias not in self.alias_names:
            raise LayoutError(f"unknown alias {alias!r}; the mesh axes are {self.alias_names}")
        return self.alias_names.index(alias)

    def position(self, rank: int) -> int:
        """Device-matrix position (row-major index) of a global rank."""
        ranks = self.ranks
        if self.rank_list is None:
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(ranks):
                raise LayoutError(f"rank {rank!r} is not in this mesh of {len(ranks)} ranks")
            return rank
        try:
            return self._positions[rank]
        except (KeyError, TypeError):
            raise LayoutError(f"rank {rank!r} is not in this layout's rank_list {list(ranks)}") from None

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of a rank along each mesh axis."""
        pos = self.position(rank)
        out = {}
        for name, size in zip(reversed(self.alias_names), reversed(self.device_matrix)):
            pos, out[name] = divmod(pos, size)
        return {name: out[name] for name in self.alias_names}

    def rank_at(self, coords: dict[str, int]) -> int:
        """The global rank at the given coordinate of every mesh axis."""
        pos = 0
        for name, size in zip(self.alias_names, self.device_matrix):
            c = coords[name]
            if not 0 <= c < size:
                raise LayoutError(f"coordinate {name}={c} is outside 0..{size - 1}")
            pos = pos * size + c
        return self.ranks[pos]

    def ranks_where(self, alias: str, coord: int) -> tuple[int, ...]:
        """The ranks whose `alias` coordinate is `coord`, in device-matrix position order: one
        slice of the position grid (a pipeline stage's ranks, an expert owner's), without a
        coords() call per rank."""
        axis = self._axis_index(alias)
        size = self.device_matrix[axis]
        if isinstance(coord, bool) or not isinstance(coord, int) or not 0 <= coord < size:
            raise LayoutError(f"coordinate {alias}={coord!r} is outside 0..{size - 1}")
        inner = math.prod(self.device_matrix[axis + 1 :])
        outer = math.prod(self.device_matrix[:axis])
        ranks = self.ranks
        return tuple(ranks[(o * size + coord) * inner + i] for o in range(outer) for i in range(inner))

    def axis_group(self, aliases: str | Sequence[str], rank: int) -> tuple[int, ...]:
        """Ranks that differ from `rank` only along the given axes (first named = most significant)."""
        names = (aliases,) if isinstance(aliases, str) else tuple(aliases)
        base = self.coords(rank)
        sizes = [self.axis_size(n) for n in names]
        group = []
        for flat in range(math.prod(sizes)):
            coords = dict(base)
            for name, size in zip(reversed(names), reversed(sizes)):
                flat, coords[name] = divmod(flat, size)
            group.append(self.rank_at(coords))
        return tuple(group)

    def axis_groups(self, aliases: str | Sequence[str]) -> list[tuple[int, ...]]:
        """Every group of ranks along the given axes, ordered by their first member's position."""
        # The groups partition the ranks: build each once, from its first rank (not once per rank,
        # which is quadratic in the group size: dp=65536 would take hours).
        groups, placed = [], set()
        for rank in self.ranks:
            if rank not in placed:
                group = self.axis_group(aliases, rank)
                placed.update(group)
                groups.append(group)
        return groups

    # ---------------------------------------------------------------- shards
    @property
    def splits(self) -> tuple[int, ...]:
        """Number of chunks along each tensor dim."""
        return tuple(math.prod(self.axis_size(a) for a in axes) for axes in self._dims())

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """Mesh axes no tensor dim is split over: ranks along them hold the same shard."""
        used = {a for axes in self._dims() for a in axes}
        return tuple(a for a in self.alias_names if a not in used)

    @property
    def replica_count(self) -> int:
        """How many ranks hold each shard."""
        return math.prod(self.axis_size(a) for a in self.replica_axes)

    def chunk_index(self, rank: int) -> tuple[int, ...]:
        """Index of the rank's chunk along each tensor dim."""
        coords = self.coords(rank)
        out = []
        for axes in self._dims():
            idx = 0
            for axis in axes:
                idx = idx * self.axis_size(axis) + coords[axis]
            out.append(idx)
        return tuple(out)

    def _check_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        shape = tuple(global_shape)
        MAX_DIMS.check(len(shape), "global shape dims", LayoutError)
        try:  # operator.index takes ints and numpy ints, not floats or strings
            if any(isinstance(s, bool) for s in shape):
                raise TypeError
            shape = tuple(operator.index(s) for s in shape)
        except TypeError:
            raise LayoutError(f"global shape {shape!r:.200} must hold ints") from None
        if len(shape) != self.ndim:
            raise LayoutError(f"global shape {shape} has {len(shape)} dims; the layout maps {self.ndim}")
        for dim, (size, parts) in enumerate(zip(shape, self.splits)):
            if size < 0:
                raise LayoutError(f"global shape {shape} has a negative size at dim {dim}")
            if size % parts:
                raise LayoutError(
                    f"dim {dim} of global shape {shape} has size {size}, not divisible into {parts} "
                    f"chunks over axes {self._dims()[dim]}; pad it or pick another layout"
                )
        return shape

    def shard_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of every rank's local shard (all shards have the same shape)."""
        shape = self._check_shape(global_shape)
        return tuple(size // parts for size, parts in zip(shape, self.splits))

    def global_slice(self, global_shape: Sequence[int], rank: int) -> tuple[slice, ...]:
        """The box of the global tensor that a rank holds."""
        local = self.shard_shape(global_shape)
        return tuple(slice(i * n, (i + 1) * n) for i, n in zip(self.chunk_index(rank), local))

    def replicas(self, rank: int) -> tuple[int, ...]:
        """Ranks holding the same shard as `rank` (itself included)."""
        return self.axis_group(self.replica_axes, rank)

    def shard_owners(self) -> dict[tuple[int, ...], tuple[int, ...]]:
        """For each chunk index, the ranks that hold it."""
        owners: dict[tuple[int, ...], list[int]] = {}
        for rank in self.ranks:
            owners.setdefault(self.chunk_index(rank), []).append(rank)
        return {k: tuple(v) for k, v in owners.items()}

    def iter_shards(self, global_shape: Sequence[int]) -> Iterator[tuple[int, tuple[slice, ...]]]:
        """(rank, global slice) for every rank, in device-matrix order."""
        for rank in self.ranks:
            yield rank, self.global_slice(global_shape, rank)

    # ---------------------------------------------------------------- text and dicts
    def spec(self) -> tuple[str | tuple[str, ...], ...]:
        """The per-dim specs this layout was called with, in MindSpore's spelling."""
        return tuple(NONE if not a else a[0] if len(a) == 1 else a for a in self._dims())

    def __str__(self) -> str:
        mesh = ", ".join(f"{n}={s}" for n, s in zip(self.alias_names, self.device_matrix))
        if self.dims is None:
            return f"Layout({mesh})"
        return f"Layout({mesh})[{', '.join(repr(s) for s in self.spec())}]"

    def to_dict(self) -> dict:
        """Plain data, as MindSpore's Layout.to_dict() plus our named dims."""
        return {
            "device_matrix": list(self.device_matrix),
            "alias_names": list(self.alias_names),
            "dims": None if self.dims is None else [list(d) for d in self.dims],
            "rank_list": None if self.rank_list is None else list(self.rank_list),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Layout:
        """Inverse of to_dict; a missing or mistyped field is a LayoutError."""
        if not isinstance(data, dict):
            raise LayoutError(f"not a layout dict: {data!r:.200}")
        missing = {"device_matrix", "alias_names", "dims"} - set(data)
        if missing:
            raise LayoutError(f"not a layout dict (missing {sorted(missing)}): {data!r:.200}")
        for key in ("device_matrix", "alias_names", "dims", "rank_list"):
            value = data.get(key)
            if not isinstance(value, (list, tuple)) and not (value is None and key in ("dims", "rank_list")):
                raise LayoutError(f"layout field {key} is {value!r:.100}; expected a list")
        dims = data["dims"]
        if dims is not None:
            for dim in dims:
                if not isinstance(dim, (list, tuple)):
                    raise LayoutError(f"layout dims entry {dim!r:.100} is not a list of mesh axes")
        return cls(
            tuple(data["device_matrix"]),
            tuple(data["alias_names"]),
            None if dims is None else tuple(tuple(d) for d in dims),
            None if data.get("rank_list") is None else tuple(data["rank_list"]),
        )
