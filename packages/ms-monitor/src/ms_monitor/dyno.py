"""MindSpore's own msMonitor hook, served by ms-monitor: ``IPCMonitor.PyDynamicMonitorProxy``.

With ``MSMONITOR_USE_DAEMON=1``, MindSpore 2.10's ``DynamicProfilerMonitor`` (a ``train.Callback``
that also offers ``step()`` for custom loops) does, as read in
``mindspore/profiler/dynamic_profiler.py`` and ``dynamic_profile/dynamic_monitor_proxy.py``:

* in a process it forks (one per node: the rank that creates the shared memory segment
  ``DynamicProfileShm<YYYYmmddHH>``), ``from IPCMonitor import PyDynamicMonitorProxy``, then
  ``init_dyno(rank)`` (a falsy return stops the poller), then ``poll_dyno()`` in a loop: a non-empty
  ``KEY=VAL`` string is parsed by ``DynamicProfilerUtils.dyno_str_to_dict``, written to the shared
  memory, and the loop sleeps ``poll_interval``; an empty string is polled again at once, so
  ``poll_dyno`` must block for a while itself;
* in the training process, at most once per second from ``step()``:
  ``update_profiler_status({"profiler_status", "current_step", "start_step", "stop_step"})`` (strings;
  status -1 uninitialized, 0 idle, 1 running, 2 ready), on a fresh proxy that never saw ``init_dyno``;
* ``enable_dyno_npu_monitor(cfg)`` on every step while the config holds ``NPU_MONITOR_START``;
* ``finalize_dyno()`` at exit.

This proxy connects to the ms-monitor daemon like an agent (role ``dyno``), so ``ms-monitor
trace`` reaches unmodified MindSpore scripts: the daemon sends an msMonitor ``nputrace`` config
(``PROFILE_START_STEP``, ``ACTIVITIES_ITERATIONS``, ``ACTIVITIES_LOG_FILE``...) that MindSpore's own
code turns into a profiler run, and the status reports give the daemon each node's current step.
``init_dyno`` returns True whether or not the daemon is up yet: the connection is made, and remade,
in the background. NPU monitor mode (MSPTI activity aggregation) needs Ascend's libmspti; here the
config is acknowledged to the daemon and logged, and no activity data is produced.
"""

from __future__ import annotations

import logging
import queue
import socket
import sys
from typing import Any

from .agent import RANK_VARS, env_int
from .shipper import Shipper

log = logging.getLogger("ms_monitor.dyno")

#: how long poll_dyno waits for a config before returning "" (MindSpore polls again at once)
POLL_WAIT = 1.0
#: the first poll's answer: a valid config that starts nothing. Without any config, MindSpore's
#: Model-callback path logs "Dynamic profiler json is not valid" on every step.
IDLE_CONFIG = "PROFILE_START_STEP=-1\nACTIVITIES_ITERATIONS=0"
#: the config line naming the ranks a trace is for (``0-3,8``). MindSpore's parser keeps a key
#: without PROFILE/ACTIVITIES as it is, so it reaches every rank's copy of the config.
RANKS_KEY = "MS_MONITOR_RANKS"


def format_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"`` (no ``=``: MindSpore splits each line at it)."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    out = [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs]
    return ",".join(out)


def rank_selected(rank: int, text: str) -> bool:
    """Whether ``rank`` is in a ``format_ranks`` list; a list that does not parse selects every rank
    (a gate must never stop a trace it cannot read)."""
    try:
        for part in str(text).split(","):
            lo, _, hi = part.strip().partition("-")
            if int(lo) <= rank <= int(hi or lo):
                return True
    except ValueError:
        return True
    return False


def install_rank_gate(cls: Any = None) -> bool:
    """Make MindSpore's ``DynamicProfilerMonitor`` (or ``cls``) in this process ignore a config
    whose ``MS_MONITOR_RANKS`` does not name the process's rank, so ``ms-monitor trace --ranks``
    is honoured by MindSpore's own hook. MindSpore polls one config per node and every rank of the
    node reads it; the rank itself must drop it. Returns whether the gate is in place.

    Installed when MindSpore loads ``IPCMonitor`` (in the rank that forks the node's poller), by
    ``import IPCMonitor`` in a script, and by ``Monitor``/``MonitorCallback`` in a process with
    MindSpore loaded. A rank without it still captures; the daemon then leaves its files out of
    the merge and says so in the job's errors.
    """
    if cls is None:
        try:
            from mindspore.profiler import DynamicProfilerMonitor as cls
        except Exception:  # no MindSpore, or one without the dynamic profiler
            return False
    getter = getattr(cls, "_get_prof_args", None)
    if getter is None:
        return False
    if getattr(getter, "_ms_monitor_gate", False):
        return True

    def _get_prof_args(self: Any) -> dict:
        cfg = getter(self)
        if isinstance(cfg, dict) and RANKS_KEY in cfg and not rank_selected(int(self._rank_id), cfg[RANKS_KEY]):
            return {}  # MindSpore's "no config": the step goes on, nothing starts
        return cfg

    _get_prof_args._ms_monitor_gate = True  # type: ignore[attr-defined]
    _get_prof_args.__doc__ = getter.__doc__
    cls._get_prof_args = _get_prof_args
    return True


def _rank() -> int:
    ms = sys.modules.get("mindspore")
    if ms is not None:
        try:
            from mindspore.profiler.dynamic_profile.dynamic_profiler_utils import DynamicProfilerUtils

            return int(DynamicProfilerUtils.get_real_rank())
        except Exception:
            pass
    return env_int(RANK_VARS, 0)


def _int(value: Any, default: int = -1) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


class PyDynamicMonitorProxy:
    """The five methods MindSpore calls (see the module docstring)."""

    def __init__(self) -> None:
        install_rank_gate()  # this process's ranks honour --ranks (see install_rank_gate)
        self._poller: Shipper | None = None
        self._status: Shipper | None = None
        self._configs: queue.Queue[str] = queue.Queue()
        self._configs.put(IDLE_CONFIG)
        self._npu_cfg: dict | None = None
        self.rank: int | None = None

    def _hello(self, poll: bool) -> dict:
        assert self.rank is not None
        import os

        return {"role": "dyno", "rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "poll": poll}

    def init_dyno(self, npu_id: int) -> bool:
        """Register with the daemon as the node's config poller (in MindSpore's forked process)."""
        self.rank = _int(npu_id, 0)
        if self._poller is None:
            self._poller = Shipper(self._hello(True), on_command=self._on_command, flush_interval=0.2)
        return True

    def poll_dyno(self) -> str:
        """The next config string from the daemon, or "" after POLL_WAIT seconds without one."""
        if self._poller is None:
            self.init_dyno(_rank())
        try:
            return self._configs.get(timeout=POLL_WAIT)
        except queue.Empty:
            return ""

    def update_profiler_status(self, status: dict) -> None:
        """Forward MindSpore's profiler status (and current step) to the daemon; never blocks."""
        if self._status is None:
            if self.rank is None:
                self.rank = _rank()
            self._status = Shipper(self._hello(False), flush_interval=0.2)
        self._status.send_control(
            {
                "t": "dstat",
                "rank": self.rank,
                "status": max(-1, min(3, _int(status.get("profiler_status")))),
                "cur": max(-1, _int(status.get("current_step"))),
                "start": max(-1, _int(status.get("start_step"))),
                "stop": max(-1, _int(status.get("stop_step"))),
            }
        )

    def enable_dyno_npu_monitor(self, cfg: dict) -> None:
        """NPU monitor mode: acknowledged and logged; MSPTI activity data needs Ascend (see the module docstring)."""
        cfg = {str(k)[:128]: str(v)[:4096] for k, v in dict(cfg).items()}
        if cfg == self._npu_cfg:
            return  # MindSpore calls this on every step while the config holds
        self._npu_cfg = cfg
        log.warning(
            "ms-monitor: npu-monitor config received; MSPTI activity monitoring needs Ascend, "
            "this host reports step progress only"
        )
        if self.rank is None:
            self.rank = _rank()
        shipper = self._poller or self._status
        if shipper is None:
            self._status = shipper = Shipper(self._hello(False), flush_interval=0.2)
        shipper.send_control({"t": "npumon", "rank": self.rank, "cfg": dict(list(cfg.items())[:64])})

    def finalize_dyno(self) -> None:
        for shipper in (self._poller, self._status):
            if shipper is not None:
                shipper.close(1.0)
        self._poller = self._status = None

    def _on_command(self, msg: dict) -> None:
        if msg["t"] == "cfg":
            log.info("ms-monitor: trace config %s for MindSpore's dynamic profiler", msg["id"])
            self._configs.put(msg["cfg"])
