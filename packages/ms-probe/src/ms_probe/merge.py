"""One dump of a pipelined step from its ranks' dumps, to compare with a single-process step.

In a pipelined step every module runs on one rank (its stage's), so the ranks' items are disjoint
and together hold what one process would have dumped; a module's call index is the microbatch
(a stage runs its microbatches in order). The merged dump orders the items as the step's data
flows: forward items by (microbatch, stage), backward items and parameter gradients by
(microbatch, stage from the last to the first), each rank's own order within. So the first
divergence of a compare is the earliest microbatch's earliest stage that went wrong. The items'
pipeline.json records (stage, microbatch, pass) are kept, and tensors are read from each item's
own rank folder.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import ProbeError
from .reader import DataEntry, DumpItem, RankDump


class MergedDump(RankDump):
    """A RankDump whose items come from several ranks' folders."""

    def __init__(self, dumps: list[RankDump]):
        first = dumps[0]
        super().__init__(first.folder, first.step, None, first.task, first.level, first.framework)
        self.sources: dict[str, RankDump] = {}
        self.ranks = [d.rank for d in dumps]
        for d in dumps:
            self.problems += [f"rank {d.rank}: {p}" for p in d.problems]
            self.damage += [f"rank {d.rank}: {p}" for p in d.damage]

    def load_tensor(self, item: DumpItem, entry: DataEntry) -> np.ndarray | None:
        source = self.sources[item.name]
        before = len(source.damage)
        array = source.load_tensor(item, entry)
        for message in source.damage[before:]:  # keep what reading the file found wrong
            self.damaged(f"rank {source.rank}: {message}")
        return array


def _key(item: DumpItem, rank_index: int) -> tuple[Any, ...]:
    where = item.where
    if where is None:  # not from a pipeline pass: after the step's items, by rank
        return (2, rank_index, 0, item.order)
    backward = item.parsed is not None and (item.parsed.direction == "backward" or item.parsed.kind == "param_grad")
    stage = -where["stage"] if backward else where["stage"]
    return (int(backward), where["microbatch"], stage, item.order)


def merge_ranks(dumps: list[RankDump]) -> MergedDump:
    """The ranks' dumps of one step as one (see the module's docstring)."""
    if not dumps:
        raise ProbeError("merge_ranks: no rank dumps to merge")
    steps = {d.step for d in dumps}
    if len(steps) > 1:
        raise ProbeError(f"merge_ranks: the dumps are of different steps {sorted(steps, key=str)}")
    tasks = {d.task for d in dumps}
    merged = MergedDump(sorted(dumps, key=lambda d: (d.rank is None, d.rank or 0)))
    merged.task = "tensor" if tasks == {"tensor"} else "statistics"
    keyed = []
    for index, d in enumerate(sorted(dumps, key=lambda d: (d.rank is None, d.rank or 0))):
        for item in d.items.values():
            if item.name in merged.sources:
                other = merged.sources[item.name].rank
                merged.note(f"{item.name} is in the dumps of ranks {other} and {d.rank}: rank {other}'s kept")
                continue
            merged.sources[item.name] = d
            keyed.append((_key(item, index), item))
    for order, (_, item) in enumerate(sorted(keyed, key=lambda ki: ki[0])):
        merged.items[item.name] = DumpItem(
            item.name, item.parsed, order, item.entries, item.parent, item.stack, item.where
        )
    return merged
