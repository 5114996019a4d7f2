"""Pass / warning / error: the thresholds and the per-module rules (numpy-free, pure).

Per data item (the colour of one row), after msprobe's published rules (docs/ms-probe.md, "Pass, warning, error"):
- tensor mode: error when shapes differ, nan/inf sit in different places, Cosine < 0.99, or the
  One Thousandth Err Ratio < 0.6; warning when that ratio < 0.9.
- statistics mode: error when shapes differ, nan/inf counts differ, or Deviation > 0.5 (msprobe's
  first-diff threshold on relative statistic errors); warning when Deviation > 0.1.

Per module call (where a divergence starts), after msprobe 26.2.0's checkers, which compare a
module's outputs with its own inputs so that an error inherited from upstream is not blamed on it:
- error: an output has nan/inf that the golden lacks; an output's shape differs; a parameter
  differs (a wrong weight is where a divergence starts);
- tensor mode: error when the inputs' smallest One Thousandth ratio is > 0.9 and the outputs' < 0.6
  (OneThousandthErrChecker); warning when the inputs' smallest cosine is > 0.9 and the outputs'
  is more than 0.1 lower (CosineWarnChecker);
- statistics mode: error when the inputs' largest deviation is < 0.1 and the outputs' > 0.5
  (RelativeErrChecker);
- both modes: warning when the outputs' deviation (relative L2 error in tensor mode, Deviation in
  statistics mode) exceeds 10x the inputs' (RelativeWarnChecker) and the noise floor 1e-3 (ours:
  without it float32 rounding, 1e-7 in, 2e-6 out, would be blamed).
A module whose rule verdict is not pass is a divergence source; the first source in execution
order (forward items in the order they completed, then backward items) is the first divergence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ORDER = {"pass": 0, "warning": 1, "error": 2}


def worst(*statuses: str) -> str:
    """The most severe of pass/warning/error (other values count as pass)."""
    return max(statuses, key=lambda s: ORDER.get(s, -1), default="pass") if statuses else "pass"


@dataclass(frozen=True)
class Thresholds:
    """The numbers behind pass/warning/error (defaults documented in the module docstring)."""

    cosine_error: float = 0.99
    """Row error below this cosine (tensor mode)."""
    ratio_error: float = 0.6
    """Row error below this One Thousandth Err Ratio (tensor mode); module error for outputs."""
    ratio_warning: float = 0.9
    """Row warning below this ratio (tensor mode); inputs count as good above it."""
    deviation_error: float = 0.5
    """Row error above this statistics Deviation; module error for outputs."""
    deviation_warning: float = 0.1
    """Row warning above this Deviation; inputs count as good below it."""
    input_cosine_ok: float = 0.9
    """CosineWarnChecker: inputs count as good above this cosine."""
    cosine_drop: float = 0.1
    """CosineWarnChecker: warning when the outputs' cosine is lower than the inputs' by more."""
    amplification: float = 10.0
    """RelativeWarnChecker: warning when the outputs' deviation exceeds this multiple of the inputs'."""
    noise_floor: float = 1e-3
    """Deviations below this are rounding noise and never flag a module."""


def deviation(mode: str, m: dict[str, Any]) -> float:
    """One comparable number per row: relative L2 error (tensor) or Deviation (statistics)."""
    v = m.get("RelL2") if mode == "tensor" else m.get("Deviation")
    if v is None:
        return 0.0
    return math.inf if (isinstance(v, float) and math.isnan(v)) else float(v)


def row_status(mode: str, m: dict[str, Any], shape_ok: bool, th: Thresholds) -> tuple[str, str]:
    """(status, message) of one compared data item."""
    if not shape_ok:
        return "error", "shape differs"
    if m.get("NonfiniteMismatch"):
        return "error", "nan/inf differ"
    if mode == "tensor":
        cos, ratio = m.get("Cosine", 1.0), m.get("One Thousandth Err Ratio", 1.0)
        if cos < th.cosine_error:
            return "error", f"Cosine {cos:.6f} < {th.cosine_error}"
        if ratio < th.ratio_error:
            return "error", f"One Thousandth Err Ratio {ratio:.4f} < {th.ratio_error}"
        if ratio < th.ratio_warning:
            return "warning", f"One Thousandth Err Ratio {ratio:.4f} < {th.ratio_warning}"
        return "pass", ""
    d = deviation(mode, m)
    if d > th.deviation_error:
        return "error", f"Deviation {d:.6g} > {th.deviation_error}"
    if d > th.deviation_warning:
        return "warning", f"Deviation {d:.4g} > {th.deviation_warning}"
    return "pass", ""


def module_verdict(
    mode: str,
    inputs: list[dict[str, Any]],
    outputs: list[dict[str, Any]],
    params: list[tuple[str, str, str]],
    th: Thresholds,
    d_in_override: float | None = None,
) -> tuple[str, str, float, float]:
    """(status, reason, input deviation, output deviation) of one module call.

    `inputs`/`outputs` are metric dicts of its matched rows (with "_shape_ok"); `params` are
    (name, row status, message) of its parameters.
    """
    d_in = max((deviation(mode, m) for m in inputs), default=0.0) if d_in_override is None else d_in_override
    d_out = max((deviation(mode, m) for m in outputs), default=0.0)
    for m in outputs:
        if m.get("NonfiniteMismatch"):
            return "error", "an output has nan/inf where the golden has none (or the reverse)", d_in, d_out
        if not m.get("_shape_ok", True):
            return "error", "an output's shape differs", d_in, d_out
    for name, status, message in params:
        if status != "pass":
            return "error", f"parameter {name} differs ({message})", d_in, d_out
    if mode == "tensor" and outputs:
        in_ratio = min((m.get("One Thousandth Err Ratio", 1.0) for m in inputs), default=1.0)
        out_ratio = min(m.get("One Thousandth Err Ratio", 1.0) for m in outputs)
        if in_ratio > th.ratio_warning and out_ratio < th.ratio_error:
            return (
                "error",
                f"One Thousandth Err Ratio of the inputs {in_ratio:.4f} > {th.ratio_warning} while the output's "
                f"{out_ratio:.4f} < {th.ratio_error}",
                d_in,
                d_out,
            )
        in_cos = min((m.get("Cosine", 1.0) for m in inputs), default=1.0)
        out_cos = min(m.get("Cosine", 1.0) for m in outputs)
        if in_cos > th.input_cosine_ok and in_cos - out_cos > th.cosine_drop:
            return "warning", f"cosine drops from {in_cos:.4f} (inputs) to {out_cos:.4f} (output)", d_in, d_out
    if mode != "tensor" and outputs and d_in < th.deviation_warning and d_out > th.deviation_error:
        return (
            "error",
            f"output deviation {d_out:.6g} > {th.deviation_error} while the inputs' is {d_in:.3g}",
            d_in,
            d_out,
        )
    if outputs and d_out > max(th.amplification * d_in, th.noise_floor):
        return (
            "warning",
            f"output deviation {d_out:.4g} is more than {th.amplification:g}x the inputs' {d_in:.3g}",
            d_in,
            d_out,
        )
    return "pass", "", d_in, d_out
