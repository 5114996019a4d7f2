"""One self-contained HTML page of the demo: every stage's checks and numbers, the ZBV schedule
drawn by ms-pipeline, the monitor's step times per rank, the probe's result and the benchmark
tables. Pictures are matplotlib PNGs embedded as base64, so the file opens anywhere alone."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
from common import StageResult

from ms_layout.files import atomic_write

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .6em 0; font-size: .9em; }
td, th { border: 1px solid #ddd; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } .pass { color: #1a7f37; font-weight: bold; } .fail { color: #c62828; font-weight: bold; }
img { max-width: 100%; border: 1px solid #eee; margin: .4em 0; }
pre { background: #f8f8f8; padding: .6em; overflow-x: auto; }
.small { font-size: .85em; color: #555; }
"""


def _esc(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list, tuple)):
        return html.escape(json.dumps(value, default=str)[:300])
    return html.escape(str(value))


def _table(rows: list[dict], columns: list[str] | None = None, limit: int = 30) -> str:
    if not rows:
        return "<p class=small>(no rows)</p>"
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_esc(r.get(c, ''))}</td>" for c in columns) + "</tr>" for r in rows[:limit])
    more = f"<p class=small>{len(rows) - limit} more rows in the JSON</p>" if len(rows) > limit else ""
    return f"<table><tr>{head}</tr>{body}</table>{more}"


def _img_file(path: Path, alt: str) -> str:
    if not path.exists():
        return f"<p class=small>({html.escape(alt)}: not drawn)</p>"
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _img_fig(fig, alt: str) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _checks(result: StageResult) -> str:
    rows = "".join(
        f"<tr><td class={'pass' if c.passed else 'fail'}>{'pass' if c.passed else 'FAIL'}</td>"
        f"<td>{html.escape(c.name)}</td><td>{html.escape(c.detail)}</td></tr>"
        for c in result.checks
    )
    return f"<table><tr><th></th><th>check</th><th>numbers</th></tr>{rows}</table>"


def _pretrain(result: StageResult, work: Path) -> str:
    n, plt = result.numbers, _plt()
    parts = [
        "<h3>ZeroBubbleV schedule (ms-pipeline, simulated at equal costs)</h3>",
        _img_file(work / "zbv_schedule.png", "ZBV schedule"),
        "<h3>The last training step as the two ranks ran it</h3>",
        _img_file(work / "zbv_measured.png", "measured ZBV step"),
    ]
    series = n.get("monitor_series") or {}
    if series.get("ranks"):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.2))
        for rank, times in zip(series["ranks"], series["step_time"]):
            pts = [(s, t) for s, t in zip(series["steps"], times) if t is not None]
            ax1.plot([s for s, _ in pts], [t for _, t in pts], marker="o", label=f"rank {rank}")
        ax1.set(xlabel="step", ylabel="step time, s", title="ms-monitor: step time per rank")
        ax1.legend()
        losses = n.get("losses") or []
        ax2.plot(range(1, len(losses) + 1), losses, marker="o", color="#c62828")
        ax2.set(xlabel="step", ylabel="loss", title="pipelined pretraining loss")
        parts += ["<h3>Monitor and loss</h3>", _img_fig(fig, "monitor step times and loss")]
    plans = "\n\n".join(f"{k}:\n{v}" for k, v in (n.get("recompute_plans") or {}).items())
    parts += [f"<h3>Recompute plans (ms-recompute)</h3><pre>{html.escape(plans)}</pre>"]
    return "".join(parts)


def _probe(result: StageResult, work: Path) -> str:
    n = result.numbers
    rows = sorted(n.get("rows") or [], key=lambda r: -(r.get("relative") or 0.0))
    return (
        f"<p>first divergence: step 1 <b>{_esc(n.get('first_divergence_step1'))}</b>, step 2 "
        f"<b>{_esc(n.get('first_divergence'))}</b>. Step 1's gradients: largest error relative to the "
        f"tensor's scale <b>{_esc(n.get('max_relative_grad_err'))}</b>, tolerance {_esc(n.get('rtol'))} = "
        f"{_esc(n.get('rtol_derivation'))}; its optimizer update against Adam on those gradients: "
        f"{_esc(n.get('max_relative_update_err'))} (tolerance {_esc(n.get('update_rtol'))}). Step 2 over "
        f"{_esc(n.get('compared_tensors'))} tensors: largest relative error {_esc(n.get('max_relative_err'))} "
        f"({_esc(n.get('worst_item'))}); weights after step 1 differ by at most "
        f"{_esc(n.get('weights_max_abs_diff_after_step_1'))}. ms-probe's own report: "
        f"<code>{_esc(n.get('report'))}</code></p>"
        "<h3>Largest differences (step 2)</h3>"
        + _table(rows, ["item", "key", "relative", "MaxAbsErr", "scale"], limit=15)
    )


def _serve(result: StageResult, work: Path) -> str:
    answers = result.numbers.get("answers") or []
    rows = [
        {"prompt": a["prompt"], "answer": json.dumps(a["text"]), "token ids": a["tokens"], "== reference": a["equal"]}
        for a in answers
    ]
    return _table(rows)


def _grpo(result: StageResult, work: Path) -> str:
    n, plt = result.numbers, _plt()
    losses, rewards = n.get("losses") or [], n.get("rewards") or []
    if not losses:
        return ""
    fig, ax = plt.subplots(figsize=(7, 3))
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, marker="o", label="loss, uninterrupted")
    resumed = n.get("resumed_losses") or []
    ax.plot(range(len(losses) - len(resumed) + 1, len(losses) + 1), resumed, "x", ms=12, label="loss, resumed")
    ax.set(xlabel="GRPO step", ylabel="loss", title="GRPO: the resumed steps land on the uninterrupted run")
    ax.set_xticks(list(steps))
    reward = ax.twinx()  # rewards and losses differ by orders of magnitude: one axis each
    reward.plot(steps, rewards, marker="s", color="#2e7d32", label="mean reward")
    reward.set_ylabel("mean reward")
    ax.legend(loc="upper left")
    reward.legend(loc="upper right")
    return _img_fig(fig, "GRPO losses")


def _recompute(result: StageResult, work: Path) -> str:
    n, plt = result.numbers, _plt()
    if "recompute_ms_sequential" not in n:
        return ""
    fig, ax = plt.subplots(figsize=(7, 3))
    labels = ["recompute part", "whole step"]
    seq = [n["recompute_ms_sequential"], n["step_ms_sequential"]]
    pair = [n["recompute_ms_paired"], n["step_ms_paired"]]
    x = np.arange(len(labels))
    ax.bar(x - 0.2, seq, 0.4, label="sequential")
    ax.bar(x + 0.2, pair, 0.4, label="paired")
    ax.set_xticks(x, labels)
    ax.set(ylabel="ms (min over reps, slowest rank)", title=f"TP=2 recompute over {n.get('link', '?')}")
    ax.legend()
    return (
        f"<p>Paired / sequential recompute part: <b>{_esc(n.get('recompute_paired_over_sequential'))}</b>"
        f" ({_esc(n.get('recompute_ms_paired'))} ms vs {_esc(n.get('recompute_ms_sequential'))} ms); one"
        f" all-reduce of {_esc(n.get('allreduce_MB'))} MB takes {_esc(n.get('allreduce_ms'))} ms on this link."
        f" Recompute order of the paired backward: <code>{_esc(n.get('paired_order'))}</code></p>"
        + _img_fig(fig, "paired vs sequential recompute")
    )


def _numbers(result: StageResult) -> str:
    skip = {"monitor_series", "losses", "rows", "answers", "recompute_plans", "plan", "rewards", "resumed_losses"}
    rows = [{"name": k, "value": v} for k, v in result.numbers.items() if k not in skip]
    return _table(rows, ["name", "value"])


def _benchmarks(folder: Path) -> str:
    parts = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        rows = data.get("rows") or []
        columns = list(dict.fromkeys(k for r in rows for k in r))[:10]
        parts.append(f"<h3>{html.escape(data.get('title', path.stem))}</h3>" + _table(rows, columns, limit=12))
    return "".join(parts) or "<p class=small>(no benchmark results found)</p>"


SECTIONS = {"pretrain": _pretrain, "probe": _probe, "serve": _serve, "grpo": _grpo, "recompute": _recompute}


def write_report(results: list[StageResult], work: Path, bench_dir: Path, total_s: float) -> Path:
    summary = [
        {"stage": r.name, "result": "pass" if r.passed else "FAIL", "seconds": round(r.seconds, 1),
         "checks": f"{sum(c.passed for c in r.checks)}/{len(r.checks)}"}
        for r in results
    ]  # fmt: skip
    body = [
        "<h1>MindSpore LLM-systems toolkit: the whole stack on CPU</h1>",
        f"<p>Total {total_s:.0f} s. Work directory <code>{html.escape(str(work))}</code>.</p>",
        _table(summary),
    ]
    for r in results:
        verdict = "pass" if r.passed else "fail"
        body.append(
            f"<h2>{html.escape(r.name)} <span class={verdict}>{verdict.upper() if not r.passed else verdict}</span>"
            f" <span class=small>{r.seconds:.1f} s</span></h2>"
        )
        body.append(_checks(r))
        body.append(_numbers(r))
        section = SECTIONS.get(r.name)
        if section and r.numbers:
            try:
                body.append(section(r, work))
            except Exception as exc:  # a broken picture must not lose the rest of the report
                body.append(f"<p class=fail>section failed: {html.escape(repr(exc))}</p>")
    body.append("<h2>Benchmarks (benchmarks/results/*.json)</h2>" + _benchmarks(bench_dir))
    head = f"<meta charset=utf-8><title>ms toolkit demo</title><style>{STYLE}</style>"
    page = f"<!doctype html><html><head>{head}</head><body>{''.join(body)}</body></html>"
    path = work / "report.html"
    atomic_write(path, page)
    return path
