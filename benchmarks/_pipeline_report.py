"""bench_pipeline.py's schedules by variant name, its simulated rows for more ranks, its printed
rows and its PNG timelines (split from the script, which runs the ranks and measures)."""

from __future__ import annotations

import sys
from pathlib import Path


def schedule_of(name: str, ranks: int, m: int):
    """A built schedule; "zbv+fused" is ZeroBubbleV with each B its own W directly follows run as
    one fused BW (ms_pipeline.fuse_adjacent_backward), the bubble-filling W's left apart; "zbv+auto"
    starts as ZeroBubbleV, whose fusions the runtime then chooses from measured costs."""
    import ms_pipeline as mp

    if name.endswith("+auto"):  # the start: PipelineRuntime.tune_backward picks the fusions at run time
        return mp.build(name.removesuffix("+auto"), ranks, m)
    if name.endswith("+fused"):
        return mp.fuse_adjacent_backward(mp.build(name.removesuffix("+fused"), ranks, m))
    if name.endswith("+1b1f"):
        return mp.build(name.removesuffix("+1b1f"), ranks, m, overlap=True)
    return mp.build(name, ranks, m)


def printable(row: dict) -> dict:
    """A row for the printed table: floats to 4 digits, the per-step lists left to the JSON."""
    return {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in row.items() if not isinstance(v, list)}


def simulated_rows(args, costs, ranks_list=(4, 8)):
    """Rows for more ranks from the costs measured at p = 2, weak scaling (every stage keeps the
    layers of a measured stage; the embedding and head stay on the end stages). A ZBV middle stage
    costs what the measured layers-only stage cost (stage 1); a 1F1B middle stage what the
    measured 1F1B stage 0 cost less the embedding's share (the difference between ZBV's stage 0
    and its layers-only stage)."""
    import ms_pipeline as mp

    z, one, fz = costs["zbv"], costs["1f1b"], costs["zbv+fused"]
    mid = 1
    embed_f = z["f"][0] - z["f"][mid]
    embed_b = (z["b"][0] + z["w"][0]) - (z["b"][mid] + z["w"][mid])

    def ends_and_middle(values, n, middle=None):
        return [values[0]] + [values[mid] if middle is None else middle] * (n - 2) + [values[-1]]

    rows = []
    if one["f"][0] <= embed_f or one["bw"][0] <= embed_b:
        # at sizes where dispatch dominates, the embedding's share measured on ZBV's stage 0
        # exceeds what 1F1B's stage 0 took: no layers-only 1F1B stage can be derived
        print("simulated rows skipped: the embedding's measured share exceeds 1F1B's stage 0", file=sys.stderr)
        return rows
    for ranks in ranks_list:
        m = max(args.microbatches, 2 * ranks)
        out = {}
        for name in ("1f1b", "zbv", "zbv+fused", "zbv+auto"):
            schedule = schedule_of(name, ranks, m)
            n = schedule.num_stages
            if name == "1f1b":
                f = ends_and_middle(one["f"], n, one["f"][0] - embed_f)
                b = ends_and_middle(one["bw"], n, one["bw"][0] - embed_b)
                cm = mp.CostModel(f=f, b=b, w=0.0, comm=0.0)
            else:
                src = fz if name.endswith(("+fused", "+auto")) else z
                bw = ends_and_middle(src["bw"], n) if src["bw"] else None
                cm = mp.CostModel(
                    f=ends_and_middle(src["f"], n), b=ends_and_middle(src["b"], n),
                    w=ends_and_middle(src["w"], n), bw=bw, comm=0.0,
                )  # fmt: skip
            if name.endswith("+auto"):  # what tune_backward would choose under these costs
                schedule = mp.fuse_where_faster(schedule, cm)
            out[name] = mp.simulate(schedule, cm).makespan
            row = {"schedule": f"{name} (simulated)", "ranks": ranks, "microbatches": m, "predicted_s": out[name]}
            row["/1f1b"] = out[name] / out["1f1b"]
            rows.append(row)
    return rows


def draw_runs(png_dir, results, args, variants, ranks, suffix="") -> None:
    """The fastest measured step of each ms-pipeline schedule as a PNG (receive waits in grey)."""
    import ms_pipeline as mp
    from ms_pipeline.draw import draw_png

    for name in variants:
        per_rank = [r[name] for r in results]
        best = min(range(len(per_rank[0]["times"])), key=lambda i: max(r["times"][i] for r in per_rank))
        events = [e for r in per_rank for e in r["events"][best]]
        t0 = min(e.start for e in events)
        events = [mp.Event(e.rank, e.action, 1e3 * (e.start - t0), 1e3 * (e.end - t0)) for e in events]
        schedule = schedule_of(name, ranks, args.microbatches)
        bubbles = mp.Bubbles.of([e for e in events if e.action.is_compute], ranks)
        title = f"{name}, measured, d={args.hidden}, m={args.microbatches}: {bubbles.makespan:.0f} ms"
        Path(png_dir).mkdir(parents=True, exist_ok=True)
        path = Path(png_dir) / f"ms-pipeline-run-{name.replace('+', '-')}{suffix}.png"
        draw_png(events, path, stage_to_rank=schedule.stage_to_rank, title=title, xlabel="ms")
