"""Uniform sampling: where the n samples of every prompt are generated among the DP inference instances.

A rollout of N prompts with n samples each is N*n requests; request ``r = p * n + j`` is sample j
of prompt p, so group order (what group-normalised advantages need) is request order. An
:class:`Assignment` lists the requests each DP inference instance generates; after generation,
:meth:`Assignment.restore` applies the inverse permutation so the groups come back together.

* :func:`contiguous_split` is the baseline: requests in group order, cut into dp contiguous slices,
  so every group sits on one instance and a prompt with long answers makes its instance the
  straggler (verl's ``repeat(interleave=True)`` then chunk; docs/rlhf-reshard-prior-art.md §1).
* :func:`uniform_split` spreads each group evenly: request r goes to instance ``r % dp``, so every
  instance gets floor(n/dp) or ceil(n/dp) samples of every prompt and the instance sizes differ by
  at most one. Long-answer prompts then load every instance alike.
* :func:`balanced_split` uses predicted lengths (say, of the same prompt in earlier epochs): a
  balanced partition (balance.py: Karmarkar-Karp, LPT, swaps) with equal request counts.

All three are pure functions of sizes and costs, so every rank computes the same assignment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from .balance import loads, partition
from .errors import RLHFError
from .limits import MAX_ROLLOUT_INSTANCES, MAX_ROLLOUT_SAMPLES
from .packing import fields_of, int_list

T = TypeVar("T")


@dataclass(frozen=True)
class Assignment:
    """Which requests each DP inference instance generates."""

    instances: tuple[tuple[int, ...], ...]
    """Per instance, the request ids it generates, in the order it receives them."""
    num_requests: int
    """Total number of requests; every id in 0..num_requests-1 appears exactly once."""
    strategy: str = ""
    """How it was made ("contiguous", "uniform", "balanced")."""

    def __post_init__(self) -> None:
        ids = [r for inst in self.instances for r in inst]
        if sorted(ids) != list(range(self.num_requests)):
            raise RLHFError(
                f"assignment must place each of the {self.num_requests} requests exactly once; got {len(ids)} "
                f"placements of {len(set(ids))} distinct ids"
            )

    @property
    def dp(self) -> int:
        """Number of instances."""
        return len(self.instances)

    @property
    def order(self) -> np.ndarray:
        """The requests of all instances back to back (the order outputs arrive in)."""
        return np.array([r for inst in self.instances for r in inst], dtype=np.int64)

    @property
    def inverse(self) -> np.ndarray:
        """inverse[r] = position of request r in `order`."""
        inv = np.empty(self.num_requests, dtype=np.int64)
        inv[self.order] = np.arange(self.num_requests)
        return inv

    def restore(self, outputs: Sequence[Sequence[T]]) -> list[T]:
        """Per-instance outputs (each in its instance's order) -> one list in request order."""
        if len(outputs) != self.dp:
            raise RLHFError(f"got outputs of {len(outputs)} instances; the assignment has {self.dp}")
        for k, (out, inst) in enumerate(zip(outputs, self.instances)):
            if len(out) != len(inst):
                raise RLHFError(f"instance {k} returned {len(out)} outputs for {len(inst)} requests")
        flat = [o for out in outputs for o in out]
        return [flat[i] for i in self.inverse]

    def loads(self, costs: Sequence[float]) -> np.ndarray:
        """Total cost per instance."""
        return loads(costs, self.instances)

    def makespan(self, costs: Sequence[float]) -> float:
        """Cost of the busiest instance."""
        return float(self.loads(costs).max())

    def group_spread(self, n: int) -> np.ndarray:
        """[num_prompts, dp]: how many samples of each prompt every instance generates."""
        out = np.zeros((self.num_requests // n, self.dp), dtype=np.int64)
        for k, inst in enumerate(self.instances):
            for r in inst:
                out[r // n, k] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain data."""
        return {
            "version": 1,
            "instances": [list(i) for i in self.instances],
            "num_requests": self.num_requests,
            "strategy": self.strategy,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Assignment:
        """Inverse of to_dict; checks every field's type."""
        data = fields_of(data, "Assignment", ("instances", "num_requests"), RLHFError)
        (num,) = int_list([data["num_requests"]], "Assignment num_requests", RLHFError)
        MAX_ROLLOUT_SAMPLES.check(num, "Assignment num_requests", RLHFError)
        instances, strategy = data["instances"], data.get("strategy", "")
        if not isinstance(instances, (list, tuple)) or len(instances) > MAX_ROLLOUT_INSTANCES.value:
            raise RLHFError(f"Assignment instances: expected a list of at most {MAX_ROLLOUT_INSTANCES.value} lists")
        if not isinstance(strategy, str):
            raise RLHFError(f"Assignment strategy={strategy!r:.40}: expected a string")
        return cls(
            tuple(int_list(i, f"Assignment instance {k}", RLHFError) for k, i in enumerate(instances)), num, strategy
        )

    def __str__(self) -> str:
        sizes = [len(i) for i in self.instances]
        return f"Assignment({self.strategy}: {self.num_requests} requests over {self.dp} instances, sizes {sizes})"


def _check(num_prompts: int, n: int, dp: int) -> int:
    for name, v in (("num_prompts", num_prompts), ("n", n), ("dp", dp)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise RLHFError(f"{name}={v!r} must be a positive int")
    return num_prompts * n


def request_ids(num_prompts: int, n: int) -> list[tuple[int, int]]:
    """(prompt, sample) of every request, in request order."""
    _check(num_prompts, n, 1)
    return [(p, j) for p in range(num_prompts) for j in range(n)]


def contiguous_split(num_prompts: int, n: int, dp: int) -> Assignment:
    """Baseline: group order cut into dp contiguous slices (sizes differ by at most one)."""
    total = _check(num_prompts, n, dp)
    bounds = [k * total // dp for k in range(dp + 1)]
    return Assignment(tuple(tuple(range(bounds[k], bounds[k + 1])) for k in range(dp)), total, "contiguous")


def uniform_split(num_prompts: int, n: int, dp: int) -> Assignment:
    """Uniform sampling: request r to instance r % dp, spreading every group over all instances."""
    total = _check(num_prompts, n, dp)
    return Assignment(tuple(tuple(range(k, total, dp)) for k in range(dp)), total, "uniform")


def balanced_split(predicted: Sequence[float], dp: int) -> Assignment:
    """Length-aware: balance the predicted generation cost per instance, equal request counts.
    `predicted[r]` is request r's predicted cost (for example its predicted response length)."""
    total = len(predicted)
    _check(max(total, 1), 1, dp)
    if total == 0:
        raise RLHFError("balanced_split got no requests")
    parts = partition(predicted, dp, equal_size=True)
    return Assignment(tuple(tuple(p) for p in parts), total, "balanced")


def split(strategy: str, num_prompts: int, n: int, dp: int, predicted: Sequence[float] | None = None) -> Assignment:
    """Dispatch on a strategy name: "contiguous", "uniform" or "balanced" (needs `predicted`)."""
    if strategy == "contiguous":
        return contiguous_split(num_prompts, n, dp)
    if strategy == "uniform":
        return uniform_split(num_prompts, n, dp)
    if strategy == "balanced":
        if predicted is None:
            raise RLHFError("strategy 'balanced' needs predicted costs per request")
        if len(predicted) != _check(num_prompts, n, dp):
            raise RLHFError(f"{len(predicted)} predicted costs for {num_prompts * n} requests")
        return balanced_split(predicted, dp)
    raise RLHFError(f"unknown sampling strategy {strategy!r}; expected 'contiguous', 'uniform' or 'balanced'")
