"""6D parallel configs: the device mesh, every rank's coordinates and groups, in Megatron's rank order.

Megatron enumerates ranks over an order string such as "tp-cp-ep-dp-pp", first token fastest. The
dense part of the model (attention, dense MLP, embeddings) lives on the mesh tp x cp x dp x pp; the
routed experts live on tp x ep x edp x pp, where the expert-parallel axis is carved out of the
cp x dp ranks and edp = dp * cp / ep (Megatron's expert data parallel, with expert TP equal to TP).
Both meshes assign the same global ranks, so one rank has coordinates in both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cache, cached_property

import numpy as np

from .errors import LayoutError
from .layout import MAX_RANKS, Layout
from .limits import Limit

MAX_VPP = Limit("MS_LAYOUT_MAX_VPP", 1024, "virtual pipeline chunks per rank")

DENSE_AXES = ("tp", "cp", "dp", "pp")
EXPERT_AXES = ("tp", "ep", "edp", "pp")
ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks of one job are split over the six kinds of parallelism."""

    dp: int = 1
    """Data-parallel size (replicas of the dense weights, each taking a slice of the batch)."""
    tp: int = 1
    """Tensor-parallel size (column/row-parallel linears, vocab-parallel embedding)."""
    cp: int = 1
    """Context-parallel size (the sequence split across ranks; weights replicated like dp)."""
    pp: int = 1
    """Pipeline-parallel size (consecutive layer blocks on different ranks)."""
    ep: int = 1
    """Expert-parallel size (routed experts split across ranks); must divide dp * cp."""
    optimizer_shard: bool = False
    """Shard optimizer state (and master weights) over the dp x cp replicas, like ZeRO-1."""
    vpp: int = 1
    """Virtual pipeline chunks per pipeline rank (interleaved 1F1B, ZeroBubbleV uses 2)."""
    order: str = "tp-cp-ep-dp-pp"
    """Rank order, fastest-varying axis first, in Megatron's spelling."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "cp", "pp", "ep", "vpp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise LayoutError(f"{name}={value!r:.50}; parallel sizes must be positive ints")
        # Checked before any mesh is built: the rank tables and groups are per rank.
        MAX_RANKS.check(self.dp * self.tp * self.cp * self.pp, "world size dp*tp*cp*pp", LayoutError)
        MAX_VPP.check(self.vpp, "vpp", LayoutError)
        if not isinstance(self.optimizer_shard, bool):
            raise LayoutError(f"optimizer_shard={self.optimizer_shard!r:.50}; expected True or False")
        tokens = tuple(self.order.split("-")) if isinstance(self.order, str) else ()
        if sorted(tokens) != sorted(ORDER_TOKENS):
            raise LayoutError(f"order {self.order!r:.100} must name each of {'-'.join(ORDER_TOKENS)} exactly once")
        if (self.dp * self.cp) % self.ep:
            raise LayoutError(f"ep={self.ep} must divide dp*cp={self.dp * self.cp}; experts split over dp/cp ranks")
        self._check_meshes_agree()

    # ---------------------------------------------------------------- meshes
    @property
    def world_size(self) -> int:
        """Number of ranks the config needs."""
        return self.dp * self.tp * self.cp * self.pp

    def check_world_size(self, world_size: int) -> None:
        """Raise a LayoutError unless the config uses exactly `world_size` ranks."""
        if world_size != self.world_size:
            raise LayoutError(
                f"{self.describe()} needs dp*tp*cp*pp={self.world_size} ranks, but the job has {world_size}"
            )

    @classmethod
    def for_world(cls, world_size: int, **sizes: int | bool | str) -> ParallelConfig:
        """A config whose dp fills `world_size` ranks given the other sizes."""
        model = 1
        for name in ("tp", "cp", "pp"):
            model *= int(sizes.get(name, 1))
        if world_size <= 0 or world_size % model:
            raise LayoutError(f"world size {world_size} is not a positive multiple of tp*cp*pp={model}")
        return cls(dp=world_size // model, **sizes)

    @property
    def edp(self) -> int:
        """Expert data-parallel size: replicas of each routed expert."""
        return self.dp * self.cp // self.ep

    def _mesh(self, sizes: dict[str, int], drop: str) -> Layout:
        fastest_first = [t for t in self.order.split("-") if t != drop]
        names = tuple(reversed(fastest_first))  # MindSpore's device matrix: last axis fastest
        return Layout(tuple(sizes[n] for n in names), names)

    @cached_property
    def mesh(self) -> Layout:
        """The dense mesh over all ranks, axes slowest first (default: pp, dp, cp, tp)."""
        return self._mesh({"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}, drop="ep")

    @cached_property
    def expert_mesh(self) -> Layout:
        """The expert mesh over all ranks (default: pp, edp, ep, tp)."""
        sizes = {"tp": self.tp, "ep": self.ep, "edp": self.edp, "pp": self.pp}
        fastest_first = [("edp" if t == "dp" else t) for t in self.order.split("-") if t != "cp"]
        names = tuple(reversed(fastest_first))
        return Layout(tuple(sizes[n] for n in names), names)

    def _check_meshes_agree(self) -> None:
        # An order that interleaves ep with tp or pp would give a rank different tp/pp
        # coordinates in the two meshes; Megatron rejects those too. Every rank's coordinates at
        # once (both meshes number ranks row-major, without a rank_list): numpy, not a loop.
        ranks = np.arange(self.world_size)
        dense, expert = _axis_coords(self.mesh, ranks), _axis_coords(self.expert_mesh, ranks)
        wrong = (dense["tp"] != expert["tp"]) | (dense["pp"] != expert["pp"])
        if wrong.any():
            rank = int(np.argmax(wrong))  # the first, as a loop over ranks finds it
            axis = "tp" if dense["tp"][rank] != expert["tp"][rank] else "pp"
            raise LayoutError(
                f"order {self.order!r} gives rank {rank} {axis}={dense[axis][rank]} in the dense mesh "
                f"but {axis}={expert[axis][rank]} in the expert mesh; keep ep between tp and pp"
            )

    # ---------------------------------------------------------------- ranks and groups
    def coords(self, rank: int) -> dict[str, int]:
        """Every coordinate of a rank: tp, cp, dp, pp, ep, edp."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank!r} is outside 0..{self.world_size - 1}")
        out = self.mesh.coords(rank)
        expert = self.expert_mesh.coords(rank)
        out.update(ep=expert["ep"], edp=expert["edp"])
        return {k: out[k] for k in ("tp", "cp", "dp", "pp", "ep", "edp")}

    def rank_table(self) -> list[dict[str, int]]:
        """One row per rank with all its coordinates."""
        return [{"rank": r, **self.coords(r)} for r in range(self.world_size)]

    def _mesh_for(self, axes: tuple[str, ...]) -> Layout:
        if set(axes) <= set(DENSE_AXES):
            return self.mesh
        if set(axes) <= set(EXPERT_AXES):
            return self.expert_mesh
        raise LayoutError(
            f"group {'-'.join(axes)!r} mixes axes of the dense mesh {DENSE_AXES} and the expert mesh "
            f"{EXPERT_AXES}, or names an unknown axis"
        )

    def groups(self, token: str) -> list[tuple[int, ...]]:
        """All groups along the axes of `token` ("tp", "dp", "dp-cp", "tp-pp", "ep", "edp", ...)."""
        axes = tuple(token.split("-")) if isinstance(token, str) and token else ()
        if not axes or len(set(axes)) != len(axes):
            raise LayoutError(f"group token {token!r} must name distinct axes joined by '-'")
        mesh = self._mesh_for(axes)
        ordered = [a for a in mesh.alias_names if a in axes]  # slowest first: members ascending
        return sorted(mesh.axis_groups(ordered))

    def group(self, token: str, rank: int) -> tuple[int, ...]:
        """The group along `token` that holds `rank`."""
        for members in self.groups(token):
            if rank in members:
                return members
        raise LayoutError(f"rank {rank!r} is outside 0..{self.world_size - 1}")

    @cache  # noqa: B019 - configs are small frozen values; planners ask per weight
    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """Ranks of one pipeline stage, in dense-mesh position order."""
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < self.pp:
            raise LayoutError(f"stage {stage!r} is outside 0..{self.pp - 1}")
        return self.mesh.ranks_where("pp", stage)

    @cache  # noqa: B019
    def stage_mesh(self, stage: int = 0, experts: bool = False) -> Layout:
        """The mesh of one pipeline stage (no pp axis), with the stage's global ranks as rank_list."""
        full = self.expert_mesh if experts else self.mesh
        names = tuple(a for a in full.alias_names if a != "pp")
        ranks = sorted(self.stage_ranks(stage), key=full.position)
        return Layout(tuple(full.axis_size(a) for a in names), names, None, tuple(ranks))

    # ---------------------------------------------------------------- text and dicts
    def describe(self) -> str:
        """One line: the sizes that are not 1."""
        parts = [f"{k}={getattr(self, k)}" for k in ("dp", "tp", "cp", "pp", "ep", "vpp") if getattr(self, k) != 1]
        if self.optimizer_shard:
            parts.append("optimizer_shard")
        return f"ParallelConfig({', '.join(parts) or 'single rank'}; {self.world_size} ranks, order {self.order})"

    def to_dict(self) -> dict:
        """Plain data (the dataclass fields)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ParallelConfig:
        """Inverse of to_dict; unknown fields are an error, not ignored."""
        if not isinstance(data, dict):
            raise LayoutError(f"not a ParallelConfig dict: {data!r:.200}")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise LayoutError(f"unknown ParallelConfig fields {sorted(unknown)}")
        return cls(**data)


def _axis_coords(mesh: Layout, positions: np.ndarray) -> dict[str, np.ndarray]:
    """The coordinate along every axis of each device-matrix position (row-major, last fastest)."""
    return dict(zip(mesh.alias_names, np.unravel_index(positions, mesh.device_matrix)))
