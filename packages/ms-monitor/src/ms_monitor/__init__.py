"""ms-monitor: always-on performance monitoring and on-demand trace capture for MindSpore training.

The agent (``Monitor``, and ``MonitorCallback`` for ``mindspore.train.Model``) times steps and
named ranges and ships compact msgpack samples to a node daemon (``Daemon``, ``ms-monitor
daemon``), which detects slow ranks, regressions and jitter, exports Prometheus metrics, JSON lines
and TensorBoard scalars, serves a live dashboard, and runs ``ms-monitor trace`` jobs that start
MindSpore's profiler on running ranks and merge their traces. ``IPCMonitor.PyDynamicMonitorProxy``
lets MindSpore's own msMonitor hook (``MSMONITOR_USE_DAEMON=1``) talk to the same daemon.

The core needs numpy and msgpack only; MindSpore is loaded by ``MonitorCallback`` and by a
capture in a process that already runs MindSpore.
"""

from __future__ import annotations

import importlib
from typing import Any

from .agent import Monitor
from .daemon import Daemon, DaemonConfig
from .detect import Alert, Detector, DetectorConfig
from .errors import MonitorError, WireError
from .trace_merge import check_chrome_trace, merge

__version__ = "0.1.0"

__all__ = [
    "Alert",
    "Daemon",
    "DaemonConfig",
    "Detector",
    "DetectorConfig",
    "Monitor",
    "MonitorCallback",
    "MonitorError",
    "WireError",
    "check_chrome_trace",
    "merge",
]


def __getattr__(name: str) -> Any:
    # The callback subclasses mindspore.train.Callback: load MindSpore only when it is asked for.
    if name == "MonitorCallback":
        return importlib.import_module(".callback", __name__).MonitorCallback
    raise AttributeError(f"module 'ms_monitor' has no attribute {name!r}")
