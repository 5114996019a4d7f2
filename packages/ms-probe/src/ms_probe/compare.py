"""Compare two dumps: align items, compute metrics, judge them, name the first divergence.

`compare_rank(target, golden, mapping)` compares one step of one rank; `compare_dirs(target_dir,
golden_dir, mapping)` pairs every (step, rank) found on both sides and says which were not. Items
align by (kind, mapped path, direction, call index): class names may differ between frameworks.
Inside an aligned pair, data items align by key (after the mapping's data renames), and what is
left pairs up in order among tensors of the same role, shape and dtype kind (`matched_by="order"`).
Beside the verdicts, each side's damage (reader.py) and first NaN/Inf (anomalies.py) are reported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .anomalies import Anomaly, first_anomaly, tensor_nonfinite
from .errors import ProbeError
from .mapping import NameMapping
from .metrics import stat_metrics, tensor_metrics
from .pairing import api_outputs_disagree, dtype_kind, item_keys, pair_entries, shapes_compatible
from .reader import DumpItem, RankDump, find_rank_dirs, load_rank
from .rules import Thresholds, module_verdict, row_status, worst

log = logging.getLogger("ms_probe")


@dataclass
class Row:
    """One compared data item (a CSV row)."""

    item: str
    key: str
    role: str
    target: str | None
    golden: str | None
    target_info: dict[str, Any] | None
    golden_info: dict[str, Any] | None
    metrics: dict[str, Any] = field(default_factory=dict)
    result: str = "unmatched"
    message: str = ""
    matched_by: str = ""


@dataclass
class ModuleResult:
    """One target item (module call, API call or parameter gradients) and its verdict."""

    name: str
    golden: str | None
    kind: str
    direction: str
    path: str
    cls: str
    order: int
    parent: str | None
    result: str
    """pass / warning / error, or unmatched / skipped."""
    source: bool = False
    """Its rule verdict blames this module itself (outputs worse than its inputs)."""
    reason: str = ""
    d_in: float = 0.0
    d_out: float = 0.0
    stack: list[str] | None = None


@dataclass
class RankCompare:
    """The comparison of one step on one rank."""

    step: int | None
    rank: int | None
    mode: str
    rows: list[Row]
    modules: list[ModuleResult]
    golden_only: list[tuple[str, str]]
    """(golden item, why it has no counterpart)."""
    first_divergence: str | None
    first_divergence_reason: str
    problems: list[str]
    mapping: str
    target_dir: str = ""
    golden_dir: str = ""
    damage: dict[str, list[str]] = field(default_factory=dict)
    """{"target": [...], "golden": [...]}: why a side is damaged or unverifiable (empty when intact)."""
    anomalies: dict[str, Anomaly | None] = field(default_factory=dict)
    """{"target": first NaN/Inf or None, "golden": ...}."""
    first_where: dict[str, Any] | None = None
    """The first divergence's pipeline pass, {stage, microbatch, pass}, in a pipelined step's dump."""
    dumps: dict[str, RankDump] = field(default_factory=dict, repr=False)
    """{"target": ..., "golden": ...}: the dumps compared (their trees and stacks, for the graph export)."""

    def damaged(self) -> list[dict[str, Any]]:
        """[{side, folder, reasons}] for each damaged side."""
        folders = {"target": self.target_dir, "golden": self.golden_dir}
        return [{"side": k, "folder": folders[k], "reasons": list(v)} for k, v in self.damage.items() if v]

    def anomaly_list(self) -> list[dict[str, str]]:
        return [a.to_dict() for a in self.anomalies.values() if a is not None]

    def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for m in self.modules:
            counts[m.result] = counts.get(m.result, 0) + 1
        row_counts: dict[str, int] = {}
        for r in self.rows:
            row_counts[r.result] = row_counts.get(r.result, 0) + 1
        matched = sum(1 for m in self.modules if m.golden is not None)
        return {
            "step": self.step,
            "rank": self.rank,
            "mode": self.mode,
            "mapping": self.mapping,
            "target_items": len(self.modules),
            "aligned_items": matched,
            "target_only": sum(1 for m in self.modules if m.result == "unmatched"),
            "skipped": sum(1 for m in self.modules if m.result == "skipped"),
            "golden_only": len(self.golden_only),
            "item_results": counts,
            "row_results": row_counts,
            "first_divergence": self.first_divergence,
            "first_divergence_reason": self.first_divergence_reason,
            "first_divergence_where": self.first_where,
            "problems": list(self.problems),
            "damaged": self.damaged(),
            "anomalies": self.anomaly_list(),
        }


# ---------------------------------------------------------------------- one rank
def _compare_pair(
    mode: str,
    td: RankDump,
    gd: RankDump,
    ti: DumpItem,
    gi: DumpItem,
    te,
    ge,
    th: Thresholds,
    seen: dict,
    mapping: NameMapping,
) -> Row:
    row = Row(
        ti.name if ti else gi.name,
        te.key if te else ge.key,
        (te or ge).role,
        f"{ti.name}.{te.key}" if te else None,
        f"{gi.name}.{ge.key}" if ge else None,
        te.info if te else None,
        ge.info if ge else None,
    )
    if te is None or ge is None:
        row.result, row.message = "unmatched", ("only in target" if ge is None else "only in golden")
        return row
    if not (te.is_tensor and ge.is_tensor):
        same = (
            te.info.get("value") == ge.info.get("value")
            if isinstance(te.info, dict) and isinstance(ge.info, dict)
            else True
        )
        row.result, row.message = ("pass", "") if same else ("warning", "values differ")
        return row
    shape_ok = shapes_compatible(te.shape, ge.shape) is None
    metrics: dict[str, Any] = {}
    row_mode = mode
    if te.shape != ge.shape and shape_ok:
        row.message = f"shapes {list(te.shape)} and {list(ge.shape)} hold the same data; compared flat"
    if mode == "tensor" and shape_ok:
        a, b = td.load_tensor(ti, te), gd.load_tensor(gi, ge)
        for side, item, entry, array in (("target", ti, te, a), ("golden", gi, ge, b)):
            what = tensor_nonfinite(array) if array is not None else None
            if what:
                seen[side].setdefault(item.name, {})[entry.key] = what
        if a is not None and b is not None and a.size == b.size:
            a = mapping.in_compare_layout("target", ti.parsed.path, ti.parsed.direction, te.role, a)
            b = mapping.in_compare_layout("golden", gi.parsed.path, gi.parsed.direction, ge.role, b)
            metrics = tensor_metrics(a.reshape(-1), b.reshape(-1))
        else:
            row_mode = "statistics"
            row.message = "tensor file unreadable; statistics compared"
    if not metrics:
        metrics = stat_metrics(te.info, ge.info)
        row_mode = "statistics"
    metrics["_mode"] = row_mode
    metrics["_shape_ok"] = shape_ok
    status, message = row_status(row_mode, metrics, shape_ok, th)
    if "md5" in te.info and "md5" in ge.info:  # summary_mode="md5": bit-exactness, reported beside the rules
        metrics["md5_equal"] = te.info["md5"] == ge.info["md5"]
        if not metrics["md5_equal"]:
            message = (message + "; " if message else "") + "md5 (CRC-32) differs"
    if te.dtype and ge.dtype and dtype_kind(te.dtype) != dtype_kind(ge.dtype):
        message = (message + "; " if message else "") + f"dtype {te.dtype} vs {ge.dtype}"
    row.metrics, row.result = metrics, status
    row.message = "; ".join(x for x in (row.message, message) if x)
    return row


def compare_rank(
    target: RankDump, golden: RankDump, mapping: NameMapping | None = None, thresholds: Thresholds | None = None
) -> RankCompare:
    """Compare one step of one rank."""
    mapping = mapping or NameMapping()
    th = thresholds or Thresholds()
    target, golden = mapping.joined(target, "target"), mapping.joined(golden, "golden")
    mode = "tensor" if target.task == "tensor" and golden.task == "tensor" else "statistics"
    g_keys, t_keys = item_keys(golden, mapping, "golden"), item_keys(target, mapping, "target")
    g_index: dict[tuple, DumpItem] = {}
    for gi in golden.items.values():
        g_index.setdefault(g_keys[gi.name], gi)
    used: set[str] = set()
    rows: list[Row] = []
    modules: list[ModuleResult] = []
    row_groups: dict[str, list[Row]] = {}
    seen: dict[str, dict[str, dict[str, str]]] = {"target": {}, "golden": {}}
    for ti in sorted(target.items.values(), key=lambda i: i.order):
        p = ti.parsed
        mr = ModuleResult(
            ti.name, None, p.kind, p.direction, p.path, p.cls, ti.order, ti.parent, "unmatched", stack=ti.stack
        )
        modules.append(mr)
        reason = mapping.skip_reason("target", p.path) if p.kind != "api" else None
        if reason:
            mr.result, mr.reason = "skipped", reason
            continue
        gi = g_index.get(t_keys[ti.name])
        if gi is None or gi.name in used:
            mr.reason = "no golden item with this path, direction and call index"
            continue
        if p.kind == "api" and api_outputs_disagree(ti, gi):
            mr.reason = (
                f"{gi.name} is the same API at the same place but its outputs have other shapes: not the same call"
            )
            continue
        used.add(gi.name)
        mr.golden = gi.name
        group = []
        for te, ge, how in pair_entries(ti, gi, mapping, gi.parsed.path):
            row = _compare_pair(mode, target, golden, ti, gi, te, ge, th, seen, mapping)
            row.matched_by = how
            group.append(row)
        rows.extend(group)
        row_groups[ti.name] = group
    _judge(modules, row_groups, mode, th)
    golden_only = []
    for gi in sorted(golden.items.values(), key=lambda i: i.order):
        if gi.name in used:
            continue
        why = mapping.skip_reason("golden", gi.parsed.path) if gi.parsed.kind != "api" else None
        golden_only.append((gi.name, why or "no target item with this path, direction and call index"))
    first, why = first_divergence(modules)
    # Read after the rows: loading tensors adds the problems of damaged .npy files.
    problems = [f"target: {p}" for p in target.problems] + [f"golden: {p}" for p in golden.problems]
    if {target.task, golden.task} == {"tensor", "statistics"}:
        problems.append("one side dumped tensors and the other statistics: compared in statistics mode")
    return RankCompare(
        target.step,
        target.rank,
        mode,
        rows,
        modules,
        golden_only,
        first,
        why,
        problems,
        mapping.name,
        str(target.folder),
        str(golden.folder),
        {"target": list(target.damage), "golden": list(golden.damage)},
        {side: first_anomaly(side, dump, seen[side]) for side, dump in (("target", target), ("golden", golden))},
        target.items[first].where if first in target.items else None,
        {"target": target, "golden": golden},
    )


def _judge(modules: list[ModuleResult], groups: dict[str, list[Row]], mode: str, th: Thresholds) -> None:
    """Module verdicts; a parameters_grad item is judged against its module's backward inputs."""
    bwd_in: dict[str, float] = {}
    for m in modules:
        group = groups.get(m.name)
        if group is None:
            continue
        matched = [r for r in group if r.golden and r.target and r.metrics]
        row_mode = "tensor" if any(r.metrics.get("_mode") == "tensor" for r in matched) else "statistics"
        row_mode = row_mode if mode == "tensor" else "statistics"
        ins = [r.metrics for r in matched if r.role == "input"]
        outs = [r.metrics for r in matched if r.role in ("output", "param_grad")]
        params = [(r.key.split(".", 1)[-1], r.result, r.message) for r in group if r.role == "parameter" and r.golden]
        override = None
        if m.kind == "param_grad":
            override = bwd_in.get(m.path)
        status, reason, d_in, d_out = module_verdict(row_mode, ins, outs, params, th, override)
        if m.kind == "module" and m.direction == "backward":
            bwd_in[m.path] = d_in
        rows_worst = worst(*(r.result for r in group if r.role in ("output", "parameter", "param_grad")))
        m.result = worst(status, rows_worst)
        m.source = status != "pass"
        m.reason = reason or (
            "an output row is flagged but so are its inputs (inherited)" if m.result != "pass" else ""
        )
        m.d_in, m.d_out = d_in, d_out
    # A parameters_grad item is written before its module's backward item: judge it again now.
    for m in modules:
        if m.kind == "param_grad" and m.path in bwd_in and m.name in groups:
            group = groups[m.name]
            outs = [r.metrics for r in group if r.golden and r.target and r.metrics]
            row_mode = (
                "statistics"
                if mode != "tensor"
                else ("tensor" if any(x.get("_mode") == "tensor" for x in outs) else "statistics")
            )
            status, reason, d_in, d_out = module_verdict(row_mode, [], outs, [], th, bwd_in[m.path])
            m.result = worst(status, worst(*(r.result for r in group)))
            m.source, m.reason, m.d_in, m.d_out = status != "pass", reason, d_in, d_out


def first_divergence(modules: list[ModuleResult]) -> tuple[str | None, str]:
    """The first source in execution order: forward items as they completed, then backward items."""
    for direction in ("forward", "backward"):
        for m in sorted(modules, key=lambda x: x.order):
            if m.direction == direction and m.source:
                return m.name, m.reason
    return None, ""


# ---------------------------------------------------------------------- folders
@dataclass
class CompareRun:
    """Every (step, rank) compared between two dump folders."""

    ranks: list[RankCompare]
    problems: list[str]

    def summary(self) -> dict[str, Any]:
        first = next((r for r in self.ranks if r.first_divergence), None)
        return {
            "compared": [{"step": r.step, "rank": r.rank} for r in self.ranks],
            "first_divergence": first.first_divergence if first else None,
            "first_divergence_rank": first.rank if first else None,
            "first_divergence_step": first.step if first else None,
            "first_divergence_reason": first.first_divergence_reason if first else "",
            "first_divergence_where": first.first_where if first else None,
            "aligned_items": sum(r.summary()["aligned_items"] for r in self.ranks),
            "target_only": sum(r.summary()["target_only"] for r in self.ranks),
            "golden_only": sum(r.summary()["golden_only"] for r in self.ranks),
            "skipped": sum(r.summary()["skipped"] for r in self.ranks),
            "problems": list(self.problems) + [p for r in self.ranks for p in r.problems],
            "damaged": [{"step": r.step, "rank": r.rank, **d} for r in self.ranks for d in r.damaged()],
            "anomalies": [{"step": r.step, "rank": r.rank, **a} for r in self.ranks for a in r.anomaly_list()],
            "per_rank": [r.summary() for r in self.ranks],
        }


def compare_dirs(
    target_dir: str,
    golden_dir: str,
    mapping: NameMapping | None = None,
    thresholds: Thresholds | None = None,
    steps: list[int] | None = None,
    ranks: list[int] | None = None,
    merge_target_ranks: bool = False,
) -> CompareRun:
    """Compare every (step, rank) present on both sides; mismatches are reported, not fatal.
    ``merge_target_ranks``: the target is a pipelined step, its ranks' dumps of each step merged
    into one (:mod:`.merge`) and compared with the golden's one rank of that step."""
    if merge_target_ranks:
        return _compare_merged(target_dir, golden_dir, mapping, thresholds, steps)
    t_dirs, g_dirs = find_rank_dirs(target_dir), find_rank_dirs(golden_dir)
    problems: list[str] = []

    def keep(key):
        return (not steps or key[0] in steps) and (not ranks or key[1] in ranks)

    t_dirs = {k: v for k, v in t_dirs.items() if keep(k)}
    g_dirs = {k: v for k, v in g_dirs.items() if keep(k)}
    pairs = [(k, t_dirs[k], g_dirs[k]) for k in sorted(t_dirs, key=str) if k in g_dirs]
    if not pairs and len(t_dirs) == 1 and len(g_dirs) == 1:
        (tk, tv), (gk, gv) = next(iter(t_dirs.items())), next(iter(g_dirs.items()))
        problems.append(
            f"target is step {tk[0]} rank {tk[1]}, golden step {gk[0]} rank {gk[1]}: compared with each other"
        )
        pairs = [(tk, tv, gv)]
    else:
        for k in sorted(set(t_dirs) - set(g_dirs), key=str):
            problems.append(f"step {k[0]} rank {k[1]}: only in the target dump ({t_dirs[k]}), not compared")
        for k in sorted(set(g_dirs) - set(t_dirs), key=str):
            problems.append(f"step {k[0]} rank {k[1]}: only in the golden dump ({g_dirs[k]}), not compared")
    if not pairs:
        raise ProbeError(
            f"no step/rank in common between {target_dir!r} ({sorted(t_dirs, key=str)}) "
            f"and {golden_dir!r} ({sorted(g_dirs, key=str)})"
        )
    results = []
    for key, tdir, gdir in pairs:
        td, gd = load_rank(tdir, key[0], key[1]), load_rank(gdir, key[0], key[1])
        results.append(compare_rank(td, gd, mapping, thresholds))
    for p in problems:
        log.warning("ms-probe compare: %s", p)
    return CompareRun(results, problems)


def _compare_merged(target_dir, golden_dir, mapping, thresholds, steps) -> CompareRun:
    """compare_dirs of a pipelined target: per step, its ranks merged against the golden's rank."""
    from .merge import merge_ranks

    t_dirs, g_dirs = find_rank_dirs(target_dir), find_rank_dirs(golden_dir)
    by_step: dict[int | None, list] = {}
    for (step, _rank), folder in sorted(t_dirs.items(), key=str):
        if not steps or step in steps:
            by_step.setdefault(step, []).append(folder)
    results, problems = [], []
    for step, folders in by_step.items():
        golden = [f for (s, _r), f in g_dirs.items() if s == step]
        if len(golden) != 1:
            raise ProbeError(
                f"step {step}: the golden dump {golden_dir!r} has {len(golden)} rank folders for it; merging the "
                "target's ranks compares them with exactly one"
            )
        merged = merge_ranks([load_rank(f) for f in folders])
        results.append(compare_rank(merged, load_rank(golden[0]), mapping, thresholds))
    if not results:
        raise ProbeError(f"no step of {target_dir!r} to compare (steps {steps})")
    return CompareRun(results, problems)
