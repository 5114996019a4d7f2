"""Compare results as files: msprobe-style CSV, JSON, and the summary (all written atomically).

CSV columns follow msprobe 26.2.0 (docs/ms-probe.md, Comparing; "NPU" is the target side, "Bench" the golden),
with ours appended: RMSE/RelL2 or Deviation, Matched_by, Module_Result, Divergence_Source.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

from ms_layout.files import atomic_write

from .compare import CompareRun, RankCompare, Row
from .metrics import percent

TENSOR_METRICS = (
    "Cosine",
    "EucDist",
    "MaxAbsErr",
    "MaxRelativeErr",
    "One Thousandth Err Ratio",
    "Five Thousandths Err Ratio",
    "RMSE",
    "RelL2",
)
STAT_METRICS = ("Max diff", "Min diff", "Mean diff", "L2norm diff")
STAT_RELATIVE = ("MaxRelativeErr", "MinRelativeErr", "MeanRelativeErr", "NormRelativeErr")


def _num(x: Any) -> Any:
    if x is None:
        return "N/A"
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    return x


def _stats(info: dict[str, Any] | None) -> list[Any]:
    info = info or {}
    return [_num(info.get(k)) if info.get(k) is not None else "N/A" for k in ("Max", "Min", "Mean", "Norm")]


def row_record(rc: RankCompare, row: Row, module_of: dict[str, Any]) -> dict[str, Any]:
    """One CSV/JSON row."""
    t, g = row.target_info or {}, row.golden_info or {}
    mode = row.metrics.get("_mode", rc.mode)
    rec: dict[str, Any] = {
        "NPU Name": row.target or "N/A",
        "Bench Name": row.golden or "N/A",
        "NPU Dtype": t.get("dtype", t.get("type", "N/A")),
        "Bench Dtype": g.get("dtype", g.get("type", "N/A")),
        "NPU Tensor Shape": t.get("shape", "N/A"),
        "Bench Tensor Shape": g.get("shape", "N/A"),
        "NPU Requires_grad": t.get("requires_grad", "N/A"),
        "Bench Requires_grad": g.get("requires_grad", "N/A"),
    }
    if rc.mode == "tensor":
        for k in TENSOR_METRICS:
            rec[k] = _num(row.metrics.get(k)) if mode == "tensor" and row.metrics else "unsupported"
    else:
        for k in STAT_METRICS:
            rec[k] = _num(row.metrics.get(k)) if row.metrics else "unsupported"
        for k in STAT_RELATIVE:
            rec[k] = percent(row.metrics.get(k)) if row.metrics else "unsupported"
        rec["Deviation"] = _num(row.metrics.get("Deviation")) if row.metrics else "unsupported"
    for side, info in (("NPU", t), ("Bench", g)):
        for label, value in zip(("max", "min", "mean", "l2norm"), _stats(info)):
            rec[f"{side} {label}"] = value
    m = module_of.get(row.item)
    rg_t, rg_g = t.get("requires_grad"), g.get("requires_grad")
    rec.update(
        {
            # MindSpore records carry no requires_grad: only a recorded disagreement counts.
            "Requires_grad Consistent": rg_t is None or rg_g is None or rg_t == rg_g,
            "Result": row.result,
            "Err_message": row.message,
            "NPU_Stack_Info": (m.stack or [""])[0] if m is not None and m.stack else "",
            "Data_name": t.get("data_name", "-") if rc.mode == "tensor" else None,
            "Matched_by": row.matched_by,
            "Module_Result": m.result if m is not None else "",
            "Divergence_Source": bool(m.source) if m is not None else False,
        }
    )
    if rc.mode != "tensor":
        rec.pop("Data_name")
    return rec


def rank_records(rc: RankCompare) -> list[dict[str, Any]]:
    module_of = {m.name: m for m in rc.modules}
    return [row_record(rc, r, module_of) for r in rc.rows]


def rank_json(rc: RankCompare) -> dict[str, Any]:
    """The JSON document of one rank: summary, every item's verdict, every row."""
    return {
        "summary": rc.summary(),
        "items": [
            {
                "name": m.name,
                "golden": m.golden,
                "kind": m.kind,
                "direction": m.direction,
                "result": m.result,
                "divergence_source": m.source,
                "reason": m.reason,
                "input_deviation": _num(m.d_in),
                "output_deviation": _num(m.d_out),
                "parent": m.parent,
            }
            for m in rc.modules
        ],
        "golden_only": [{"name": n, "reason": why} for n, why in rc.golden_only],
        "rows": rank_records(rc),
    }


def _csv_bytes(records: list[dict[str, Any]]) -> bytes:
    buf = io.StringIO()
    if records:
        w = csv.DictWriter(buf, fieldnames=list(records[0]))
        w.writeheader()
        for r in records:
            w.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()})
    return buf.getvalue().encode()


def write_results(run: CompareRun, out_dir: str | Path, html: bool = True, vis: bool = True) -> dict[str, str]:
    """compare_result_step{S}_rank{R}.csv/.json per rank, summary.json, report.html and
    compare.vis.db (MindStudio's graph visualizer: `tensorboard --logdir out_dir`, :mod:`.vis_db`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    for rc in run.ranks:
        step = rc.step if rc.step is not None else "x"
        rank = rc.rank if rc.rank is not None else "x"
        stem = f"compare_result_step{step}_rank{rank}"
        atomic_write(out / f"{stem}.csv", _csv_bytes(rank_records(rc)))
        doc = json.dumps(rank_json(rc), indent=1, default=str).encode()
        atomic_write(out / f"{stem}.json", doc)
        files[f"{stem}.csv"] = str(out / f"{stem}.csv")
        files[f"{stem}.json"] = str(out / f"{stem}.json")
    summary = run.summary()
    atomic_write(out / "summary.json", json.dumps(summary, indent=1, default=str).encode())
    files["summary.json"] = str(out / "summary.json")
    if html:
        from .report import render_html

        atomic_write(out / "report.html", render_html(run).encode())
        files["report.html"] = str(out / "report.html")
    if vis and run.ranks and all(rc.dumps for rc in run.ranks):
        from .vis_db import write_vis_db

        files["compare.vis.db"] = str(write_vis_db(run, out / "compare.vis.db"))
    return files
