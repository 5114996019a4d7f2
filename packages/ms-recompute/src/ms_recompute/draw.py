"""Draw measured recompute steps as a timeline (PNG): per rank, a compute lane and a collective lane.

Input is the runtime's trace (``AppliedPlan.events``, or plain dicts with the same fields: layer, op,
index, start, end, and rank), so a picture comes from real timestamps, never from a model. A
collective is drawn from the end of its ``issue`` (the all-reduce is in flight) to the end of its
``wait``; the part of it that the ``wait`` spent blocked is drawn solid: that is the communication the
overlap did not hide.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from ms_layout.files import atomic_path

from .errors import RecomputeError

_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")


def _get(event: Any, name: str) -> Any:
    return event[name] if isinstance(event, Mapping) else getattr(event, name)


def draw_timeline(panels: Mapping[str, Sequence[Any]], path: str | os.PathLike, title: str = "") -> str:
    """``panels``: title -> events (each with rank, layer, op, index, start, end in seconds). One row
    of panels, a shared time axis in milliseconds from each panel's first event. Returns the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:  # pragma: no cover - depends on the environment
        raise RecomputeError("drawing needs matplotlib: pip install 'ms-recompute[draw]'") from None
    if not panels:
        raise RecomputeError("draw_timeline got no panels")
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.0 + 1.6 * len(panels) * 2), squeeze=False)
    layers = sorted({_get(e, "layer") for events in panels.values() for e in events})
    colour = {layer: _COLOURS[i % len(_COLOURS)] for i, layer in enumerate(layers)}
    longest = 0.0
    for ax, (name, events) in zip(axes[:, 0], panels.items()):
        events = [e for e in events if _get(e, "op") != "recompute"]
        if not events:
            raise RecomputeError(f"panel {name!r} has no compute, issue or wait events")
        t0 = min(_get(e, "start") for e in events)
        ranks = sorted({_get(e, "rank") for e in events})
        labels = []
        for row, rank in enumerate(ranks):
            mine = [e for e in events if _get(e, "rank") == rank]
            y_compute, y_comm = 2 * row * 1.2 + 1.2, 2 * row * 1.2
            labels += [(y_comm, f"rank {rank} all-reduce"), (y_compute, f"rank {rank} compute")]
            issued = {}
            for e in mine:
                op, layer, index = _get(e, "op"), _get(e, "layer"), _get(e, "index")
                start, end = (_get(e, "start") - t0) * 1e3, (_get(e, "end") - t0) * 1e3
                longest = max(longest, end)
                bar = {"color": colour[layer], "edgecolor": "black", "lw": 0.5}
                if op == "compute":
                    ax.barh(y_compute, end - start, left=start, height=0.8, **bar)
                    ax.text((start + end) / 2, y_compute, f"L{layer}.c{index}", ha="center", va="center", fontsize=7)
                elif op == "issue":
                    issued[layer, index] = end
                elif op == "wait":
                    begin = issued.get((layer, index), start)
                    ax.barh(y_comm, end - begin, left=begin, height=0.5, color=colour[layer], alpha=0.35, hatch="//")
                    ax.barh(y_comm, end - start, left=start, height=0.5, **bar)
        ax.set_yticks([y for y, _ in labels], [text for _, text in labels], fontsize=8)
        ax.set_title(name, fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_xlim(0, longest * 1.02)
    axes[-1, 0].set_xlabel("ms since the recompute started")
    handles = [Patch(color=colour[layer], label=f"layer {layer}") for layer in layers]
    handles += [
        Patch(facecolor="white", edgecolor="black", hatch="//", label="all-reduce issued, not yet awaited"),
        Patch(facecolor="grey", edgecolor="black", label="blocked waiting for it"),
    ]
    fig.legend(handles=handles, loc="lower center", fontsize=7, ncol=len(handles), frameon=False)
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0.04, 1, 0.96))
    path = os.fspath(path)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=130, format="png")  # the temporary name has no suffix to tell the format
    finally:
        plt.close(fig)
    return path
