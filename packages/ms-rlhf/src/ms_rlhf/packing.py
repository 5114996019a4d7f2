"""Dynamic packing: variable-length samples into packs of at most `max_pack_len` tokens and at most
`max_pack_count` samples, never truncating one, in as few packs as we can find.

This is bin packing with a cardinality constraint. :func:`pack` runs first-fit-decreasing and
best-fit-decreasing, keeps the better, then -- unless it already meets the lower bound -- places
the samples into a fixed number of packs from the bound upwards (fixed_bins.py: what works when the
count cap binds), and improves what it has with a depth-first branch and bound (node-limited; exact
for the small batches of an RL step).
The bound is the largest of Martello and Toth's L2 bound, ceil(n / max_pack_count) and a
cardinality bound (samples over half a pack each open one, which has count - 1 slots left);
ceil(total tokens / max_pack_len) is reported too. A sample longer than `max_pack_len` is an
error naming it: mindrlhf's next-fit packer silently truncated such samples (its
``pad_sequence_to_length`` slices; docs/rlhf-reshard-prior-art.md §2).

:class:`Pack` carries what a varlen forward needs: cumulative sequence lengths (FlashAttention's
cu_seqlens), positions that restart at 0 per sample, and the sample id of every token.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import PackingError
from .fixed_bins import fit_into
from .limits import MAX_PACK_SAMPLES
from .pack_bounds import _check, lower_bound, token_bound

NODE_LIMIT = 50_000
"""Branch-and-bound nodes per call: a few tens of ms in Python, enough to settle most RL batches."""
EXACT_MAX_ITEMS = 400
"""Above this many samples only the greedy packers run (the search would be too deep to help)."""


def fields_of(data: Any, kind: str, required: Sequence[str], error: type[Exception] = PackingError) -> dict:
    """`data` as a dict holding `required` keys and version 1 (a plain-data form read back)."""
    if not isinstance(data, dict):
        raise error(f"{kind} data is {type(data).__name__}, expected an object")
    missing = [k for k in required if k not in data]
    if missing:
        raise error(f"{kind} data lacks {missing}")
    version = data.get("version", 1)
    if isinstance(version, bool) or version != 1:
        raise error(f"{kind} data has version {version!r:.40}; this reader knows version 1")
    return data


def int_list(value: Any, what: str, error: type[Exception] = PackingError) -> tuple[int, ...]:
    """A list of plain ints (no bools, floats or strings), as a tuple."""
    if not isinstance(value, (list, tuple)):
        raise error(f"{what}: expected a list of ints, got {type(value).__name__}")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise error(f"{what}: {v!r:.40} is not an int")
    return tuple(int(v) for v in value)


# ---------------------------------------------------------------------------------------- packers
def _greedy(arr: np.ndarray, cap: int, count: int, best_fit: bool) -> list[list[int]]:
    loads: list[int] = []
    packs: list[list[int]] = []
    for i in sorted(range(arr.size), key=lambda i: (-arr[i], i)):
        size = int(arr[i])
        fits = [b for b in range(len(packs)) if loads[b] + size <= cap and len(packs[b]) < count]
        if not fits:
            packs.append([i])
            loads.append(size)
            continue
        b = min(fits, key=lambda b: (cap - loads[b], b)) if best_fit else fits[0]
        packs[b].append(i)
        loads[b] += size
    return packs


def next_fit(lengths: Sequence[int], max_pack_len: int, max_pack_count: int | None = None) -> list[list[int]]:
    """The baseline: samples in arrival order, a new pack whenever the next one does not fit
    (mindrlhf's grouping, without its truncation). For comparisons only."""
    arr, count = _check(lengths, max_pack_len, max_pack_count)
    packs: list[list[int]] = []
    load = 0
    for i, size in enumerate(arr.tolist()):
        if not packs or load + size > max_pack_len or len(packs[-1]) >= count:
            packs.append([])
            load = 0
        packs[-1].append(i)
        load += size
    return packs


class _Search:
    """Depth-first branch and bound over items in decreasing size; bins tried fullest first."""

    def __init__(self, arr: np.ndarray, cap: int, count: int, best: list[list[int]], bound: int, node_limit: int):
        self.order = sorted(range(arr.size), key=lambda i: (-arr[i], i))
        self.sizes = [int(arr[i]) for i in self.order]
        self.suffix = np.concatenate([np.cumsum(self.sizes[::-1])[::-1], [0]]).tolist()
        self.cap, self.count, self.bound = cap, count, bound
        self.best, self.nodes, self.node_limit = best, 0, node_limit
        self.exhausted = True

    def run(self) -> None:
        self._place(0, [], [], [])

    def _place(self, i: int, loads: list[int], counts: list[int], bins: list[list[int]]) -> bool:
        """Returns True to stop the whole search (bound met or node limit)."""
        if len(self.best) <= self.bound:
            return True
        self.nodes += 1
        if self.nodes > self.node_limit:
            self.exhausted = False
            return True
        if i == len(self.sizes):
            if len(bins) < len(self.best):
                self.best = [[self.order[j] for j in b] for b in bins]
            return len(self.best) <= self.bound
        # prune: tokens and sample slots still needed beyond what the open bins can take
        open_bins = [b for b in range(len(bins)) if counts[b] < self.count]
        free = sum(self.cap - loads[b] for b in open_bins)
        slots = sum(self.count - counts[b] for b in open_bins)
        need = max(-(-(self.suffix[i] - free) // self.cap), -(-(len(self.sizes) - i - slots) // self.count), 0)
        if len(bins) + need >= len(self.best):
            return False
        size, seen = self.sizes[i], set()
        for b in sorted(open_bins, key=lambda b: (-loads[b], b)):
            if loads[b] + size > self.cap or (loads[b], counts[b]) in seen:
                continue  # bins in the same state are interchangeable: try one of them
            seen.add((loads[b], counts[b]))
            loads[b] += size
            counts[b] += 1
            bins[b].append(i)
            stop = self._place(i + 1, loads, counts, bins)
            bins[b].pop()
            counts[b] -= 1
            loads[b] -= size
            if stop:
                return True
        if len(bins) + 1 < len(self.best):
            stop = self._place(i + 1, [*loads, size], [*counts, 1], [*bins, [i]])
            if stop:
                return True
        return False


@dataclass(frozen=True)
class PackPlan:
    """Samples grouped into packs, with how close the count is to the lower bound."""

    packs: tuple[tuple[int, ...], ...]
    """Per pack, the sample indices it holds (ascending); packs ordered by their first sample."""
    lengths: tuple[int, ...]
    """Token count of every sample."""
    max_pack_len: int
    """Most tokens a pack may hold."""
    max_pack_count: int
    """Most samples a pack may hold."""
    lower_bound: int
    """max(Martello-Toth L2, ceil(n / max_pack_count), count_bound): no packing can use fewer packs."""
    optimal: bool
    """True when the pack count is proven minimal (it meets the bound or the search finished)."""
    method: str = ""
    """Which packer produced it ("ffd", "bfd", "fixed": a fixed pack count, "search")."""
    search_nodes: int = field(default=0, compare=False)
    """Branch-and-bound nodes visited."""

    @property
    def num_packs(self) -> int:
        """Number of packs."""
        return len(self.packs)

    @property
    def num_tokens(self) -> int:
        """Tokens over all samples."""
        return int(sum(self.lengths))

    @property
    def token_bound(self) -> int:
        """ceil(total tokens / max_pack_len)."""
        return token_bound(self.lengths, self.max_pack_len)

    def pack_tokens(self) -> list[int]:
        """Tokens in each pack."""
        return [sum(self.lengths[i] for i in p) for p in self.packs]

    def fill(self) -> float:
        """Tokens / (packs * max_pack_len): the share of a fixed-shape pack that is real tokens."""
        return self.num_tokens / (self.num_packs * self.max_pack_len) if self.packs else 1.0

    def pack(self, index: int) -> Pack:
        """The `index`-th pack with its cu_seqlens, positions and token sample ids."""
        return Pack(self.packs[index], tuple(self.lengths[i] for i in self.packs[index]))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (msgpack-able)."""
        return {
            "version": 1,
            "packs": [list(p) for p in self.packs],
            "lengths": list(self.lengths),
            "max_pack_len": self.max_pack_len,
            "max_pack_count": self.max_pack_count,
            "lower_bound": self.lower_bound,
            "optimal": self.optimal,
            "method": self.method,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PackPlan:
        """Inverse of to_dict; checks every field's type and validates the packs against the limits."""
        data = fields_of(data, "PackPlan", ("packs", "lengths", "max_pack_len", "max_pack_count", "lower_bound"))
        lengths = int_list(data["lengths"], "PackPlan lengths")
        MAX_PACK_SAMPLES.check(len(lengths), "PackPlan len(lengths)", PackingError)
        packs = data["packs"]
        if not isinstance(packs, (list, tuple)) or len(packs) > max(len(lengths), 1):
            raise PackingError(f"PackPlan packs: expected a list of at most {len(lengths)} packs")
        ints = {k: int_list([data[k]], f"PackPlan {k}")[0] for k in ("max_pack_len", "max_pack_count", "lower_bound")}
        optimal, method = data.get("optimal", False), data.get("method", "")
        if not isinstance(optimal, bool) or not isinstance(method, str):
            raise PackingError(
                f"PackPlan optimal={optimal!r:.40} / method={method!r:.40}: expected a bool and a string"
            )
        plan = cls(
            tuple(int_list(p, f"PackPlan pack {k}") for k, p in enumerate(packs)),
            lengths,
            ints["max_pack_len"],
            ints["max_pack_count"],
            ints["lower_bound"],
            optimal,
            method,
        )
        validate(plan)
        return plan

    def __str__(self) -> str:
        head = (
            f"PackPlan: {len(self.lengths)} samples, {self.num_tokens} tokens -> {self.num_packs} packs "
            f"(<= {self.max_pack_len} tokens, <= {self.max_pack_count} samples); lower bound {self.lower_bound}"
            f"{' (optimal)' if self.optimal else ''}, ceil(tokens/max_pack_len) = {self.token_bound}, "
            f"fill {self.fill():.1%} [{self.method}]"
        )
        rows = [f"  pack {k}: {self.pack_tokens()[k]:>6} tokens  samples {list(p)}" for k, p in enumerate(self.packs)]
        return "\n".join([head, *rows[:32], *(["  ..."] if len(rows) > 32 else [])])


def validate(plan: PackPlan) -> None:
    """Every sample in exactly one pack; no pack over either limit."""
    ids = sorted(i for p in plan.packs for i in p)
    if ids != list(range(len(plan.lengths))):
        raise PackingError(f"packs must hold each of the {len(plan.lengths)} samples exactly once")
    for k, p in enumerate(plan.packs):
        tokens = sum(plan.lengths[i] for i in p)
        if tokens > plan.max_pack_len or len(p) > plan.max_pack_count:
            raise PackingError(
                f"pack {k} holds {len(p)} samples / {tokens} tokens; limits are {plan.max_pack_count} / "
                f"{plan.max_pack_len}"
            )


def plan_packs(
    lengths: Sequence[int], max_pack_len: int, max_pack_count: int | None = None, node_limit: int = NODE_LIMIT
) -> PackPlan:
    """Pack the samples into as few packs as we can find; the plan says how close to the bound."""
    arr, count = _check(lengths, max_pack_len, max_pack_count)
    bound = lower_bound(arr, max_pack_len, count)
    candidates = {"ffd": _greedy(arr, max_pack_len, count, False), "bfd": _greedy(arr, max_pack_len, count, True)}
    method = min(candidates, key=lambda m: (len(candidates[m]), m))
    best = candidates[method]
    for m in range(bound, len(best)):  # the greedy packers waste slots when the count cap binds
        fixed = fit_into(arr, max_pack_len, count, m)
        if fixed is not None:
            best, method = fixed, "fixed"
            break
    optimal, nodes = len(best) <= bound, 0
    if not optimal and arr.size <= EXACT_MAX_ITEMS and node_limit > 0:
        search = _Search(arr, max_pack_len, count, best, bound, node_limit)
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 2 * arr.size + 100))
        try:
            search.run()
        finally:
            sys.setrecursionlimit(limit)
        if len(search.best) < len(best):
            best, method = search.best, "search"
        optimal, nodes = search.exhausted or len(best) <= bound, search.nodes
    packs = tuple(sorted(tuple(sorted(p)) for p in best))
    plan = PackPlan(packs, tuple(int(n) for n in arr), int(max_pack_len), count, bound, optimal, method, nodes)
    validate(plan)
    return plan


def pack(lengths: Sequence[int], max_pack_len: int, max_pack_count: int | None = None) -> list[list[int]]:
    """Group samples into packs of <= max_pack_len tokens and <= max_pack_count samples (None: no
    count limit), minimising the number of packs; returns each pack's sample indices.

    A sample longer than max_pack_len raises PackingError naming it (nothing is truncated).
    """
    return [list(p) for p in plan_packs(lengths, max_pack_len, max_pack_count).packs]


# ---------------------------------------------------------------------------------------- one pack
@dataclass(frozen=True)
class Pack:
    """One pack: samples back to back in one row."""

    sample_ids: tuple[int, ...]
    """Global indices of the samples, in row order."""
    lengths: tuple[int, ...]
    """Their token counts."""

    @property
    def num_tokens(self) -> int:
        """Tokens in the pack (before any padding)."""
        return int(sum(self.lengths))

    @property
    def cu_seqlens(self) -> np.ndarray:
        """[0, l0, l0 + l1, ...] (int32), as FlashAttention's varlen API and ms_models take."""
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int32)

    @property
    def positions(self) -> np.ndarray:
        """Position of every token in its own sample (restarts at 0)."""
        return np.concatenate([np.arange(n) for n in self.lengths]).astype(np.int32)

    @property
    def segment_ids(self) -> np.ndarray:
        """Index within the pack of every token's sample (0, 0, 1, 1, 1, ...)."""
        return np.repeat(np.arange(len(self.lengths)), self.lengths).astype(np.int32)

    @property
    def token_sample_ids(self) -> np.ndarray:
        """Global sample id of every token."""
        return np.repeat(np.asarray(self.sample_ids, np.int64), self.lengths)

    def layout(self, pad_to: int | None = None) -> dict[str, np.ndarray]:
        """positions, segment_ids and token_sample_ids (-1 on padding), padded to `pad_to` tokens.
        Padding tokens form one extra segment of their own, so no sample attends to them."""
        n = self.num_tokens
        pad = 0 if pad_to is None else pad_to - n
        if pad < 0:
            raise PackingError(f"pack of {n} tokens cannot be padded to {pad_to}")
        return {
            "positions": np.concatenate([self.positions, np.arange(pad)]).astype(np.int32),
            "segment_ids": np.concatenate([self.segment_ids, np.full(pad, len(self.lengths))]).astype(np.int32),
            "token_sample_ids": np.concatenate([self.token_sample_ids, np.full(pad, -1)]).astype(np.int64),
        }


def padding_ratio(lengths: Sequence[int], rows: Sequence[Sequence[int]], row_len: int | None = None) -> float:
    """Share of padding when each row (a list of sample ids) is padded to `row_len` (default: the
    longest row): 1 - real tokens / (rows * row_len)."""
    arr = np.asarray(lengths, np.int64)
    per_row = [int(arr[list(r)].sum()) for r in rows]
    width = max(per_row) if row_len is None else row_len
    return 1.0 - float(arr.sum()) / (len(rows) * width) if rows and width else 0.0


def padded_batches(num_samples: int, batch_size: int) -> list[list[int]]:
    """The unpacked baseline: consecutive samples, `batch_size` per micro-batch."""
    return [list(range(i, min(i + batch_size, num_samples))) for i in range(0, num_samples, batch_size)]
