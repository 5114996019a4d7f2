"""Where stages live (stage -> rank) and which layers each stage holds (stage -> layer range).

Two stage-to-rank styles, as in PyTorch's ``generate_stage_to_rank_mapping``:

* ``loop``: stage s on rank s % p (1F1B, interleaved 1F1B);
* ``v``: the chunk index zig-zags, so with two chunks per rank, rank i holds stages i and 2p-1-i
  (ZeroBubbleV, Qi et al. 2024 Section 6; MindSpore's ``pipeline_segment`` doc example puts layers
  {0,7}, {1,6}, {2,5}, {3,4} on stages 0..3). The turn of the V (stages p-1 and p) is on one rank,
  so no transfer is needed there.

Layer placement is a separate choice, because real models are not uniform: the embedding and the
head make the first and last stages heavier (Megatron's ``--decoder-first-pipeline-num-layers``,
torchtitan's ``first_stage_less_layers``), so users give layer counts per stage, or per-layer
costs to balance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import ScheduleError


def stage_to_rank(num_ranks: int, stages_per_rank: int = 1, style: str = "loop") -> tuple[int, ...]:
    """Rank of each of the ``num_ranks * stages_per_rank`` stages."""
    if num_ranks < 1 or stages_per_rank < 1:
        raise ScheduleError(f"num_ranks and stages_per_rank must be >= 1, got {num_ranks}, {stages_per_rank}")
    if style == "loop":
        return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))
    if style == "v":
        out = []
        for chunk in range(stages_per_rank):
            ranks = range(num_ranks) if chunk % 2 == 0 else range(num_ranks - 1, -1, -1)
            out.extend(ranks)
        return tuple(out)
    raise ScheduleError(f"placement style must be 'loop' or 'v', got {style!r}")


@dataclass(frozen=True)
class LayerPlacement:
    """Contiguous layer ranges, one per stage: stage s holds layers ``bounds[s]:bounds[s+1]``."""

    bounds: tuple[int, ...]
    """Cumulative layer counts: 0, end of stage 0, ..., number of layers."""

    def __post_init__(self) -> None:
        b = tuple(int(x) for x in self.bounds)
        object.__setattr__(self, "bounds", b)
        if len(b) < 2 or b[0] != 0:
            raise ScheduleError(f"bounds must start at 0 and name at least one stage, got {b}")
        for s, (lo, hi) in enumerate(zip(b, b[1:])):
            if hi <= lo:
                raise ScheduleError(f"stage {s} would hold no layers (bounds {b}); every stage needs at least one")

    @classmethod
    def from_counts(cls, counts: Sequence[int]) -> LayerPlacement:
        """From layers per stage, e.g. ``[3, 4, 4, 3]``."""
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + int(c))
        return cls(tuple(bounds))

    @classmethod
    def parse(cls, text: str) -> LayerPlacement:
        """From ``"3,4,4,3"`` (layers per stage)."""
        try:
            return cls.from_counts([int(x) for x in text.split(",")])
        except ValueError:
            raise ScheduleError(f"layer counts must be comma-separated ints, got {text!r}") from None

    @classmethod
    def even(
        cls, num_layers: int, num_stages: int, *, first: int | None = None, last: int | None = None
    ) -> LayerPlacement:
        """Spread layers evenly; ``first``/``last`` pin the first and last stages' counts (lighter
        stages to offset the embedding and the head). Leftover layers go to the earliest of the
        remaining stages, as picotron does."""
        if num_stages < 1:
            raise ScheduleError(f"num_stages must be >= 1, got {num_stages}")
        pinned = {0: first, num_stages - 1: last}
        pinned = {s: c for s, c in pinned.items() if c is not None}
        free = [s for s in range(num_stages) if s not in pinned]
        rest = num_layers - sum(pinned.values())
        if (free and rest < len(free)) or (not free and rest != 0):
            raise ScheduleError(
                f"cannot place {num_layers} layers on {num_stages} stages with first={first}, last={last}"
            )
        counts = [0] * num_stages
        for s, c in pinned.items():
            counts[s] = c
        for i, s in enumerate(free):
            counts[s] = rest // len(free) + (1 if i < rest % len(free) else 0)
        return cls.from_counts(counts)

    @classmethod
    def balanced(cls, layer_costs: Sequence[float], num_stages: int) -> LayerPlacement:
        """Contiguous split of layers with the given costs that minimises the costliest stage
        (the classic linear-partition dynamic programme; exact, O(layers^2 x stages))."""
        n = len(layer_costs)
        if not 1 <= num_stages <= n:
            raise ScheduleError(f"cannot split {n} layers into {num_stages} non-empty stages")
        prefix = [0.0]
        for c in layer_costs:
            prefix.append(prefix[-1] + float(c))
        inf = float("inf")
        # best[k][i]: the smallest max-stage cost of the first i layers on k stages; cut[k][i]: its last cut
        best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
        cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
        best[0][0] = 0.0
        for k in range(1, num_stages + 1):
            for i in range(k, n + 1):
                for j in range(k - 1, i):
                    cost = max(best[k - 1][j], prefix[i] - prefix[j])
                    if cost < best[k][i]:
                        best[k][i], cut[k][i] = cost, j
        bounds = [n]
        for k in range(num_stages, 0, -1):
            bounds.append(cut[k][bounds[-1]])
        return cls(tuple(reversed(bounds)))

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.bounds) - 1

    @property
    def num_layers(self) -> int:
        """Number of layers over all stages."""
        return self.bounds[-1]

    @property
    def counts(self) -> tuple[int, ...]:
        """Layers per stage."""
        return tuple(hi - lo for lo, hi in zip(self.bounds, self.bounds[1:]))

    def layers(self, stage: int) -> range:
        """The layer indices of ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ScheduleError(f"stage {stage} is outside 0..{self.num_stages - 1}")
        return range(self.bounds[stage], self.bounds[stage + 1])

    def stage_of(self, layer: int) -> int:
        """The stage holding ``layer``."""
        for s in range(self.num_stages):
            if self.bounds[s] <= layer < self.bounds[s + 1]:
                return s
        raise ScheduleError(f"layer {layer} is outside 0..{self.num_layers - 1}")
