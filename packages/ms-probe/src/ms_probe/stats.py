"""Tensor statistics and tensor-info records in msprobe's dump.json format (numpy only).

A tensor-info record is what dump.json holds for one tensor: `type`, `dtype`, `shape`, the
statistics `Max`, `Min`, `Mean`, `Norm` (L2), and ours `NanCount`/`InfCount`; tensor mode adds
`data_name` (the .npy file), md5 mode adds `md5` (a CRC-32, as msprobe does in dynamic graph).
Non-finite floats are written as the strings "nan", "inf", "-inf" so that the JSON stays strict
(browsers and other tools reject bare NaN), and `json_float` reads them back.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

STAT_KEYS = ("Max", "Min", "Mean", "Norm")
_sum, _max, _min = np.add.reduce, np.maximum.reduce, np.minimum.reduce


def to_json_float(x: Any) -> float | str | None:
    """A Python float for JSON, or "nan"/"inf"/"-inf" for non-finite values."""
    if x is None:
        return None
    x = float(x)
    if math.isfinite(x):
        return x
    if math.isnan(x):
        return "nan"
    return "inf" if x > 0 else "-inf"


def json_float(x: Any) -> float | None:
    """Read back a statistic written by `to_json_float` (also accepts msprobe's "NaN"/"Inf" spellings)."""
    if x is None or isinstance(x, bool):
        return None if x is None else float(x)
    if isinstance(x, (int, float)):
        try:
            return float(x)
        except OverflowError:  # an integer beyond float range (hand-written JSON)
            return math.inf if x > 0 else -math.inf
    if isinstance(x, str):
        try:
            return float(x.strip().lower())
        except ValueError:
            return None
    return None


def _as_float(a: np.ndarray) -> np.ndarray:
    """A float view for statistics: float32/64 as they are, anything else (fp16, bf16, ints) as float32/64."""
    if a.dtype.kind == "f" and a.dtype.itemsize >= 4:
        return a
    if a.dtype.kind in "iu" and a.dtype.itemsize >= 4:
        return a.astype(np.float64)
    return a.astype(np.float32)


def _norm(flat: np.ndarray) -> float:
    """L2 norm as sqrt(x . x), what numpy.linalg.norm computes for a real vector, without its
    error-state and dispatch overhead (a dump takes hundreds per step); recomputed in float64
    when the float32 dot overflows (a -3.4e38 attention mask does: BLAS sets no numpy warning)."""
    square = float(np.dot(flat, flat))
    if not math.isfinite(square) and flat.dtype != np.float64:
        wide = flat.astype(np.float64)
        square = float(np.dot(wide, wide))
    return math.sqrt(square) if math.isfinite(square) else square


def array_stats(a: np.ndarray) -> dict[str, Any]:
    """Max, Min, Mean, Norm (L2), NanCount and InfCount of an array, as JSON-ready values."""
    if a.size == 0:
        return {"Max": None, "Min": None, "Mean": None, "Norm": None, "NanCount": 0, "InfCount": 0}
    if a.dtype == np.bool_:
        return {
            "Max": bool(a.any()),
            "Min": bool(a.all()),
            "Mean": float(a.mean()),
            "Norm": None,
            "NanCount": 0,
            "InfCount": 0,
        }
    x = _as_float(np.asarray(a))
    # In memory order: a view, also of a column-major array (MindSpore's weight gradients are
    # transposed views; reshape(-1) copied them). The sums then add in memory order.
    flat = x.ravel(order="K")
    # float32 arrays are summed in float32: numpy's pairwise sum keeps ~log2(n) ulp of error, and a
    # float64 accumulator made the mean the slowest of the four statistics. The ufuncs' reduce is
    # what ndarray.sum/max/min call, less their argument handling (a dump takes ~1000 a step).
    mean = float(_sum(flat)) / flat.size
    if not math.isfinite(mean) and flat.dtype != np.float64:  # a float32 sum can overflow (a -3.4e38 mask)
        mean = float(_sum(flat, dtype=np.float64)) / flat.size
    nan = inf = 0
    if not math.isfinite(mean):
        # Only pay for the counts when something is off: a finite mean means all elements are finite.
        nan = int(np.count_nonzero(np.isnan(flat)))
        inf = int(np.count_nonzero(np.isinf(flat)))
    return {
        "Max": to_json_float(_max(flat)),
        "Min": to_json_float(_min(flat)),
        "Mean": to_json_float(mean),
        "Norm": to_json_float(_norm(flat)),
        "NanCount": nan,
        "InfCount": inf,
    }


def crc32_hex(a: np.ndarray) -> str:
    """CRC-32 of the array's bytes as 8 hex digits (msprobe's `md5` summary mode is a CRC-32 too)."""
    return f"{zlib.crc32(np.ascontiguousarray(a).tobytes()) & 0xFFFFFFFF:08x}"


def tensor_info(
    a: np.ndarray,
    *,
    type_name: str,
    dtype_name: str,
    summary_mode: str = "statistics",
    requires_grad: bool | None = None,
    statistics: bool = True,
) -> dict[str, Any]:
    """The dump.json record of one tensor given as a numpy array (already on the host);
    `statistics=False` leaves Max/Min/Mean/Norm None, for a caller that fills them later."""
    info: dict[str, Any] = {"type": type_name, "dtype": dtype_name, "shape": list(a.shape)}
    info.update(array_stats(a) if statistics else dict.fromkeys(STAT_KEYS))
    if summary_mode == "md5":
        info["md5"] = crc32_hex(a)
    if requires_grad is not None:
        info["requires_grad"] = bool(requires_grad)
    return info


def scalar_info(value: Any) -> dict[str, Any] | None:
    """The record of a non-tensor value: numbers, bools and strings keep their value, the rest is null."""
    if isinstance(value, bool):
        return {"type": "bool", "value": value}
    if isinstance(value, int):
        return {"type": "int", "value": value}
    if isinstance(value, float):
        return {"type": "float", "value": to_json_float(value)}
    if isinstance(value, str):
        return {"type": "str", "value": value}
    if isinstance(value, slice):
        return {"type": "slice", "value": [value.start, value.stop, value.step]}
    return None
