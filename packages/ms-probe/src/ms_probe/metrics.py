"""Compare metrics (numpy only), as msprobe defines them (docs/ms-probe.md, Metrics), N = target, B = golden:

tensor mode: Cosine = N·B/(|N||B|), EucDist = |N-B|, MaxAbsErr = max|N-B|, MaxRelativeErr = max|N-B|/|B|,
RMSE, One/Five Thousandths Err Ratio = share of elements whose relative error is below 0.001/0.005;
plus ours: RelL2 = |N-B|/|B| (the relative L2 error, one number comparable with statistics mode).
statistics mode: Max/Min/Mean/L2norm diff = stat(N) - stat(B) and their relative errors
|diff / stat(B)|; plus ours: Deviation = max(|dNorm|/|B.Norm|, max(|dMax|, |dMin|, |dMean|) / scale(B))
with scale(B) = max(|B.Max|, |B.Min|): relative to the tensor's magnitude, so a mean near zero
does not blow up, and a change that keeps the norm (a transposed weight) still shows in Max/Min.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .stats import json_float

TINY = 1e-30


def tensor_metrics(n: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Element-wise comparison of two same-shape arrays (any numeric dtype) in float64."""
    x = np.asarray(n, dtype=np.float64).reshape(-1)
    y = np.asarray(b, dtype=np.float64).reshape(-1)
    nonfinite_mismatch = 0
    if not (np.isfinite(np.add.reduce(x)) and np.isfinite(np.add.reduce(y))):
        # Slow path only when something is non-finite (a finite sum means every element is finite):
        # non-finite values must sit at the same places with the same value, else it is an error.
        fx, fy = np.isfinite(x), np.isfinite(y)
        same_nonfinite = (fx == fy) & ((fx & fy) | (np.isnan(x) & np.isnan(y)) | (x == y))
        nonfinite_mismatch = int((~same_nonfinite).sum())
        mask = fx & fy
        x, y = x[mask], y[mask]
    out: dict[str, Any] = {"NonfiniteMismatch": nonfinite_mismatch, "Elements": int(x.size)}
    if x.size == 0:
        out.update(Cosine=1.0, EucDist=0.0, MaxAbsErr=0.0, MaxRelativeErr=0.0, RMSE=0.0, RelL2=0.0)
        out.update({"One Thousandth Err Ratio": 1.0, "Five Thousandths Err Ratio": 1.0})
        return out
    diff = x - y
    abs_err = np.abs(diff)
    ay = np.abs(y)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = abs_err / ay  # x/0 -> inf, 0/0 -> nan: both handled below
    rel[np.isnan(rel)] = 0.0
    nx, ny = float(np.sqrt(np.dot(x, x))), float(np.sqrt(np.dot(y, y)))
    euc = float(np.sqrt(np.dot(diff, diff)))
    if nx < TINY and ny < TINY:
        cosine = 1.0
    elif nx < TINY or ny < TINY:
        cosine = 0.0
    else:
        cosine = float(np.dot(x, y) / (nx * ny))
    out.update(
        Cosine=cosine,
        EucDist=euc,
        MaxAbsErr=float(abs_err.max()),
        MaxRelativeErr=float(rel.max()),
        RMSE=euc / math.sqrt(x.size),
        RelL2=euc / ny if ny > TINY else (0.0 if euc < TINY else math.inf),
    )
    out["One Thousandth Err Ratio"] = float(np.mean(rel < 0.001))
    out["Five Thousandths Err Ratio"] = float(np.mean(rel < 0.005))
    return out


def _rel(d: float | None, base: float | None) -> float | None:
    if d is None or base is None:
        return None
    if d == 0:
        return 0.0  # also when the base is nan (nan on both sides)
    if abs(base) < TINY:
        return 0.0 if abs(d) < TINY else math.inf
    return abs(d / base)


def stat_metrics(n: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Statistic differences of two tensor-info records (dump.json entries)."""
    out: dict[str, Any] = {}
    vals = {}
    for key, label in (("Max", "Max"), ("Min", "Min"), ("Mean", "Mean"), ("Norm", "L2norm")):
        vn, vb = json_float(n.get(key)), json_float(b.get(key))
        d = None if vn is None or vb is None else vn - vb
        if d is not None and not math.isfinite(d):
            # inf - inf of equal sign, or nan on both sides, is no difference: the NaN/Inf itself is
            # reported as an anomaly of each side (anomalies.py), as tensor mode compares finite elements.
            d = 0.0 if (vn == vb or (math.isnan(vn) and math.isnan(vb))) else math.inf
        vals[key] = (vn, vb, d)
        out[f"{label} diff"] = d
        out[f"{'Norm' if key == 'Norm' else key}RelativeErr"] = _rel(d, vb)
    nb = [abs(v) for v in (vals["Max"][1], vals["Min"][1]) if v is not None and math.isfinite(v)]
    scale = max(nb) if nb else 0.0
    parts = [out.get("NormRelativeErr")]
    for key in ("Max", "Min", "Mean"):
        d = vals[key][2]
        if d is not None:
            parts.append(_rel(d, scale))
    parts = [p for p in parts if p is not None]
    out["Deviation"] = max(parts) if parts else 0.0
    nan_n, nan_b = int(n.get("NanCount") or 0), int(b.get("NanCount") or 0)
    inf_n, inf_b = int(n.get("InfCount") or 0), int(b.get("InfCount") or 0)
    for key in ("Max", "Min", "Mean"):  # records without counts (msprobe's) still show nan/inf in their stats
        vn, vb, _ = vals[key]
        if vn is not None and not math.isfinite(vn) and (vb is None or math.isfinite(vb)):
            nan_n += 1
    out["NonfiniteMismatch"] = int(nan_n != nan_b or inf_n != inf_b)
    return out


def percent(x: float | None) -> str:
    """msprobe writes statistics relative errors as strings with a '%'."""
    if x is None:
        return "N/A"
    if not math.isfinite(x):
        return "inf%"
    return f"{x * 100:.6g}%"
