"""The HTML report: one self-contained page (no scripts, no external files).

Per compared rank: a summary, the first divergence (its rows and call stack), the module tree
of forward calls coloured by each module's worst result (forward and backward badges, the
output deviation as the worst metric), golden-only modules, and every row in a folded table.
The path to the first divergence is unfolded and the module itself is outlined.
A damaged dump gets a box saying which side and why, above everything else; the first NaN/Inf of
each side gets a box and a "nan/inf" badge on its node.
"""

from __future__ import annotations

import html
import math
from typing import Any

from .compare import CompareRun, ModuleResult, RankCompare

NAN_COLOR = "#6a1b9a"
COLORS = {"pass": "#2e7d32", "warning": "#f9a825", "error": "#c62828", "unmatched": "#9e9e9e", "skipped": "#bdbdbd"}
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.meta{color:#555;font-size:13px} table{border-collapse:collapse;font-size:12px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top;overflow-wrap:anywhere}
th{background:#f5f5f5}
.badge{display:inline-block;min-width:54px;text-align:center;border-radius:3px;color:#fff;font-size:11px;
 padding:1px 4px;margin-right:4px}
.tree ul{list-style:none;margin:0;padding-left:18px;border-left:1px dotted #ccc} .tree li{margin:2px 0}
.tree summary{cursor:pointer} .node{font-family:ui-monospace,Menlo,monospace;font-size:12.5px}
.cls{color:#777} .dev{color:#555;font-size:11px;margin-left:6px}
.first{outline:3px solid #c62828;outline-offset:2px;background:#ffebee;font-weight:600}
.firstbox{border:2px solid #c62828;background:#fff5f5;padding:10px 14px;border-radius:6px;overflow-x:auto}
.nanbox{border:2px solid #6a1b9a;background:#f3e5f5;padding:10px 14px;border-radius:6px;margin:8px 0}
.okbox{border:2px solid #2e7d32;background:#f1f8e9;padding:10px 14px;border-radius:6px}
.problems li{color:#8d6e00} pre{font-size:11px;background:#fafafa;padding:6px;overflow-x:auto}
.legend span{margin-right:10px}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _badge(result: str, label: str | None = None) -> str:
    return f'<span class="badge" style="background:{COLORS.get(result, "#9e9e9e")}">{_e(label or result)}</span>'


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        return f"{x:.6g}"
    return _e(x)


def _rows_table(rows, mode: str) -> str:
    keys = (
        ["Cosine", "MaxAbsErr", "MaxRelativeErr", "RMSE", "One Thousandth Err Ratio", "Five Thousandths Err Ratio"]
        if mode == "tensor"
        else ["Max diff", "Min diff", "Mean diff", "L2norm diff", "NormRelativeErr", "Deviation"]
    )
    head = "".join(f"<th>{_e(k)}</th>" for k in ["target", "golden", "shape", *keys, "result", "message"])
    body = []
    for r in rows:
        shape = (r.target_info or r.golden_info or {}).get("shape", "")
        cells = [_e(r.target or "-"), _e(r.golden or "-"), _e(shape)]
        cells += [_fmt(r.metrics.get(k, "")) if r.metrics else "" for k in keys]
        cells += [_badge(r.result), _e(r.message)]
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _tree(rc: RankCompare) -> str:
    """Nested lists of forward module/API calls; backward results shown beside their forward call."""
    fwd = [m for m in rc.modules if m.direction == "forward"]
    by_name = {m.name: m for m in fwd}
    children: dict[str | None, list[ModuleResult]] = {}
    for m in sorted(fwd, key=lambda x: x.order):
        parent = m.parent if m.parent in by_name else None
        children.setdefault(parent, []).append(m)
    bwd = {}
    for m in rc.modules:
        if m.direction == "backward" and m.kind == "module":
            bwd.setdefault(m.path, []).append(m)
    first = next((m for m in rc.modules if m.name == rc.first_divergence), None)
    nan = rc.anomalies.get("target")
    nan_item = (nan.item if nan.direction == "forward" else _forward_of(fwd, nan.item)) if nan else None
    open_path: set[str] = set()
    if first is not None:
        name = first.name if first.direction == "forward" else None
        if name is None:
            name = next((m.name for m in fwd if m.path == first.path), None)
        while name is not None and name in by_name:
            open_path.add(name)
            name = by_name[name].parent

    def node(m: ModuleResult) -> str:
        label = f"{m.path}" + (f' <span class="cls">{_e(m.cls)}</span>' if m.cls else "")
        badges = _badge(m.result, f"fwd {m.result}")
        for b in bwd.get(m.path, []):
            badges += _badge(b.result, f"bwd {b.result}")
        if m.name == nan_item:
            badges += f'<span class="badge" style="background:{NAN_COLOR}" title="{_e(nan.what)}">nan/inf</span>'

        dev = f'<span class="dev">out dev {_fmt(m.d_out)}</span>' if m.golden else ""
        is_first = first is not None and (
            m.name == first.name or (first.direction != "forward" and m.path == first.path)
        )
        cls = "node first" if is_first else "node"
        marker = " &larr; FIRST DIVERGENCE" if is_first else ""
        text = f'<span class="{cls}" title="{_e(m.reason)}">{badges}{label}{dev}{marker}</span>'
        kids = children.get(m.name, [])
        if not kids:
            return f"<li>{text}</li>"
        opened = " open" if (m.name in open_path or not first) and len(open_path) < 60 else ""
        inner = "".join(node(k) for k in kids)
        return f"<li><details{opened}><summary>{text}</summary><ul>{inner}</ul></details></li>"

    return '<div class="tree"><ul>' + "".join(node(m) for m in children.get(None, [])) + "</ul></div>"


def _forward_of(fwd: list[ModuleResult], item: str) -> str | None:
    """The forward call of the module a backward item belongs to (the tree shows forward calls)."""
    path = item.split(".", 1)[-1].rsplit(".", 3)[0]
    return next((m.name for m in fwd if m.path == path), None)


def _damage_and_nan(rc: RankCompare) -> list[str]:
    parts = []
    for d in rc.damaged():
        reasons = "".join(f"<li>{_e(r)}</li>" for r in d["reasons"])
        parts.append(
            f'<div class="firstbox"><b>The {_e(d["side"])} dump is damaged or unverifiable</b> '
            f"({_e(d['folder'])}); its verdicts are not to be trusted:<ul>{reasons}</ul></div>"
        )
    nans = rc.anomaly_list()
    if nans:
        lines = "".join(
            f"<li>{_e(a['side'])}: <code>{_e(a['item'])}</code> {_e(a['key'])} ({_e(a['what'])})</li>" for a in nans
        )
        parts.append(
            f'<div class="nanbox"><b>First NaN/Inf</b> (execution order: forward, then backward)<ul>{lines}</ul></div>'
        )
    return parts


def _rank_section(rc: RankCompare) -> str:
    s = rc.summary()
    parts = [f"<h2>Step {_e(rc.step)} &middot; rank {_e(rc.rank)}</h2>"]
    counts = ", ".join(f"{_badge(k)} {v}" for k, v in sorted(s["item_results"].items()))
    parts.append(
        f'<p class="meta">mode <b>{_e(rc.mode)}</b> &middot; mapping <b>{_e(rc.mapping)}</b> &middot; '
        f"{s['aligned_items']} items aligned, {s['target_only']} only in target, {s['golden_only']} only in golden, "
        f"{s['skipped']} skipped by the mapping<br>target {_e(rc.target_dir)}<br>golden {_e(rc.golden_dir)}</p>"
        f"<p>{counts}</p>"
    )
    parts += _damage_and_nan(rc)
    first = next((m for m in rc.modules if m.name == rc.first_divergence), None)
    if first is not None:
        rows = [r for r in rc.rows if r.item == first.name]
        stack = "\n".join(first.stack[:6]) if first.stack else ""
        parts.append(
            f'<div class="firstbox"><b>First divergence:</b> <code>{_e(first.name)}</code> '
            f"(golden <code>{_e(first.golden)}</code>)<br>{_badge(first.result)} {_e(first.reason)}"
            f"{_rows_table(rows, rc.mode)}" + (f"<pre>{_e(stack)}</pre>" if stack else "") + "</div>"
        )
    else:
        parts.append('<div class="okbox"><b>No divergence:</b> every aligned module passes its rules.</div>')
    if rc.problems:
        parts.append('<ul class="problems">' + "".join(f"<li>{_e(p)}</li>" for p in rc.problems) + "</ul>")
    parts.append("<h3>Module tree (forward calls)</h3>" + _tree(rc))
    if rc.golden_only:
        items = "".join(f"<tr><td>{_e(n)}</td><td>{_e(w)}</td></tr>" for n, w in rc.golden_only)
        parts.append(
            f"<details><summary>{len(rc.golden_only)} golden-only items</summary><table>{items}</table></details>"
        )
    parts.append(f"<details><summary>All {len(rc.rows)} rows</summary>{_rows_table(rc.rows, rc.mode)}</details>")
    return "\n".join(parts)


def render_html(run: CompareRun) -> str:
    """The whole report as one HTML string."""
    s = run.summary()
    legend = " ".join(_badge(k) for k in COLORS)
    legend += f' <span class="badge" style="background:{NAN_COLOR}">nan/inf</span>'
    head = (
        f"<h1>ms-probe compare</h1><p class='meta'>first divergence: <b>{_e(s['first_divergence'] or 'none')}</b>"
        f"{' (rank ' + _e(s['first_divergence_rank']) + ')' if s['first_divergence'] else ''}"
        f"{' &middot; <b>' + str(len(s['damaged'])) + ' damaged dump(s)</b>' if s['damaged'] else ''}"
        f"{' &middot; NaN/Inf in ' + str(len(s['anomalies'])) + ' dump(s)' if s['anomalies'] else ''}</p>"
        f'<p class="legend">{legend}</p>'
    )
    problems = ""
    if run.problems:
        problems = '<ul class="problems">' + "".join(f"<li>{_e(p)}</li>" for p in run.problems) + "</ul>"
    body = "\n".join(_rank_section(rc) for rc in run.ranks)
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>ms-probe compare</title>'
        f"<style>{CSS}</style></head><body>{head}{problems}{body}</body></html>"
    )
