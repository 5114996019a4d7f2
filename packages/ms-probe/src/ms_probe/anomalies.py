"""NaN and Inf anywhere in a dump, and the first item where they appear (pure; used by compare.py).

A NaN that both sides share is no divergence (the rules compare the two sides), yet it is almost
always a bug worth knowing about: each side is scanned on its own, statistics of every record and
the tensor files the compare read, in the dump's execution order (forward items as they completed,
then backward items, as for the first divergence).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .reader import RankDump
from .records import nonfinite


@dataclass(frozen=True)
class Anomaly:
    """The first NaN/Inf of one side of a comparison."""

    side: str
    """"target" or "golden"."""
    item: str
    key: str
    """The data item (`output.0`, `input.1`, `weight`, ...)."""
    what: str
    """"3 nan, 1 inf", "Max = inf", "1 inf in the tensor file"."""
    direction: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def tensor_nonfinite(a: np.ndarray) -> str | None:
    """What is non-finite in a tensor ("2 nan, 1 inf in the tensor file"), or None."""
    if a.dtype.kind != "f" or a.size == 0:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.add.reduce(a.reshape(-1), dtype=np.float64)):
            return None  # a finite sum means every element is finite
    nan, inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
    if not (nan or inf):
        return None
    return ", ".join(x for x in (f"{nan} nan" if nan else "", f"{inf} inf" if inf else "") if x) + " in the tensor file"


def first_anomaly(side: str, dump: RankDump, in_tensors: dict[str, dict[str, str]]) -> Anomaly | None:
    """The first record with a non-finite statistic, or a tensor file (`in_tensors`: {item: {key:
    what}}, found while comparing) with a non-finite element."""
    items = sorted(dump.items.values(), key=lambda i: i.order)
    for direction in ("forward", "backward"):
        for item in items:
            if item.parsed.direction != direction:
                continue
            seen = in_tensors.get(item.name, {})
            for e in item.entries:
                what = nonfinite(e.info) or seen.get(e.key)
                if what:
                    return Anomaly(side, item.name, e.key, what, direction)
    return None
