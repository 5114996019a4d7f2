"""The daemon's periodic work on its event loop: clock probes, trace deadlines, /dev/shm sweeps, flushes.

Every ``TICK`` seconds the daemon sends each connection that answers clock probes a ``ping`` (the
``pong`` comes back through the normal dispatch, see ``clock.py``) and lets the trace jobs time out;
every ``SHM_SWEEP`` seconds it removes stale shared memory segments (``shm.py``), and every
``FLUSH`` seconds it flushes its exporters. A failure is logged and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from . import shm
from .conn import Conn

log = logging.getLogger("ms_monitor.daemon")
#: seconds between two rounds of periodic work
TICK = 0.5
#: seconds between sweeps for stale shared memory segments (``shm.py``)
SHM_SWEEP = 2.0
#: seconds between flushes of the exporters (JSON lines, TensorBoard)
FLUSH = 5.0


def probe_clocks(conns: Iterable[Conn]) -> None:
    """Send every connection that answers probes a clock probe; the answers come back as ``pong``."""
    now = time.time()
    for conn in conns:
        if conn.clk:
            conn.send({"t": "ping", "d": now})


def sweep_shm(enabled: bool) -> None:
    """Remove stale shared memory segments (``shm.py``), unless the daemon was told to keep them."""
    if enabled:
        try:
            shm.clean_stale_segments()
        except OSError as exc:  # no /proc, no /dev/shm: nothing to look after
            log.debug("ms-monitor daemon: shared memory sweep: %s", exc)


async def run(conns: set[Conn], traces: Any, clean_shm: bool, writers: Sequence[Any]) -> None:
    """The periodic loop (until cancelled): `conns` is the daemon's live set of connections,
    `traces` its ``TraceManager``, `writers` its exporters (None where off)."""
    last_flush = last_sweep = time.monotonic()
    while True:
        await asyncio.sleep(TICK)
        try:
            probe_clocks(conns)
            traces.tick()
            if time.monotonic() - last_sweep > SHM_SWEEP:
                sweep_shm(clean_shm)
                last_sweep = time.monotonic()
            if time.monotonic() - last_flush > FLUSH:
                for w in writers:
                    if w is not None:
                        w.flush()
                last_flush = time.monotonic()
        except Exception:
            log.exception("ms-monitor daemon: periodic work failed")
