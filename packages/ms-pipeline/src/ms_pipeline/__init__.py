"""ms-pipeline: pipeline-parallel schedules for MindSpore as data.

Build a schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZeroBubbleV), validate it, lower it to
sends and receives, simulate it under a cost model, draw it, serialize it, and run it on real
processes (``ms_pipeline.runtime``, which imports MindSpore). The core needs numpy and msgpack.
"""

from __future__ import annotations

import importlib
from typing import Any

from .draw import chrome_trace, draw_png, read_chrome_trace, write_chrome_trace
from .errors import ScheduleError
from .ir import Action, Kind, Schedule, format_actions, parse_actions
from .lower import lower, step_simulate
from .placement import LayerPlacement, stage_to_rank
from .schedules import (
    BUILDERS,
    build,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
    zero_bubble_v,
    zero_bubble_v_adaptive,
)
from .serialize import dumps, from_csv, load, loads, save, to_csv
from .simulate import Bubbles, CostModel, Event, SimResult, mean_durations, peak_activation, simulate
from .trace import check_trace, replay
from .transforms import fuse_adjacent_backward, fuse_backward, fuse_where_faster, split_pairs
from .validate import format_grid, is_valid, validate

__version__ = "0.1.0"

__all__ = [
    "BUILDERS",
    "Action",
    "Bubbles",
    "CostModel",
    "Event",
    "Kind",
    "LayerPlacement",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "build",
    "check_trace",
    "chrome_trace",
    "draw_png",
    "dumps",
    "format_actions",
    "format_grid",
    "from_csv",
    "fuse_adjacent_backward",
    "fuse_backward",
    "fuse_where_faster",
    "gpipe",
    "interleaved_1f1b",
    "is_valid",
    "load",
    "loads",
    "lower",
    "mean_durations",
    "one_f_one_b",
    "parse_actions",
    "peak_activation",
    "read_chrome_trace",
    "replay",
    "runtime",
    "save",
    "simulate",
    "split_pairs",
    "stage_to_rank",
    "step_simulate",
    "to_csv",
    "validate",
    "write_chrome_trace",
    "zero_bubble_h1",
    "zero_bubble_v",
    "zero_bubble_v_adaptive",
]


def __getattr__(name: str) -> Any:
    # `ms_pipeline.runtime` imports MindSpore: loaded on first use so that the core stays numpy-only.
    if name == "runtime":
        return importlib.import_module(".runtime", __name__)
    raise AttributeError(f"module 'ms_pipeline' has no attribute {name!r}")
