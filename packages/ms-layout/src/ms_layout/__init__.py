"""ms-layout: tensor layouts, 6D parallel configs, rank/group math and process groups.

The core (layouts, configs, serialization) needs numpy and msgpack only; ``ms_layout.comm`` loads
torch (gloo) or MindSpore when a process group is created.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import console, files, limits
from .errors import CommError, LayoutError, RankFailedError
from .layout import NONE, Layout
from .mindspore_compat import from_mindspore, to_mindspore
from .parallel_config import ParallelConfig
from .serialization import dumps, loads
from .sharding import shard, unshard
from .weights import ParamPlacement, Role, layer_stages, optimizer_layout, param_placement, role_of, weight_layout

__version__ = "0.1.0"

__all__ = [
    "NONE",
    "CommError",
    "Layout",
    "LayoutError",
    "ParallelConfig",
    "ParamPlacement",
    "RankFailedError",
    "Role",
    "comm",
    "console",
    "dumps",
    "files",
    "from_mindspore",
    "layer_stages",
    "limits",
    "loads",
    "optimizer_layout",
    "param_placement",
    "role_of",
    "shard",
    "to_mindspore",
    "unshard",
    "weight_layout",
]


def __getattr__(name: str) -> Any:
    # `ms_layout.comm` is loaded on first use so that importing the core stays numpy-only.
    if name == "comm":
        return importlib.import_module(".comm", __name__)
    raise AttributeError(f"module 'ms_layout' has no attribute {name!r}")
