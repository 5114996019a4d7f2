"""Statistics computed beside the step (`async_dump`): a thread fills the tensor records.

numpy's reductions release the GIL, so a worker thread computes Max/Min/Mean/Norm while the model
goes on dispatching its next operations (a PyNative step on CPU spends much of its time in Python,
between kernels). The record is returned at once with the statistics still unset; the thread sets
them; `drain()` waits for every pending one and runs before a step's JSON is written. The tensor is
kept alive until its statistics are done: when the dumper reads it in place (DLPack), a later
in-place update of the same tensor before the worker reaches it would change the statistics, which
is why this is a switch (`DumpConfig.async_dump`, msprobe's name), and why the queue is short.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import numpy as np

from .stats import STAT_KEYS, array_stats

_FILLED = (*STAT_KEYS, "NanCount", "InfCount")

QUEUE_DEPTH = 64
"""Records waiting at most; the step blocks when the worker is this far behind (bounds the memory kept alive)."""


class StatsWorker:
    """One daemon thread computing `array_stats` into records handed to `submit`."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue(QUEUE_DEPTH)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ms-probe-stats", daemon=True)
        self._thread.start()

    def submit(self, record: dict[str, Any], array: np.ndarray | None, keep: Any = None) -> None:
        """Fill `record`'s statistics from `array` later; `keep` (the tensor) lives until then.
        Without an array, `keep` is an earlier record of the same tensor: its statistics are copied
        once filled (records are filled in the order submitted)."""
        self._queue.put((record, array, keep))

    def drain(self) -> None:
        """Wait until every submitted record is filled; re-raise a failure of the thread."""
        self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while True:
            record, array, keep = self._queue.get()
            try:
                if array is None:
                    record.update({k: keep[k] for k in _FILLED})
                else:
                    record.update(array_stats(array))
            except BaseException as e:  # handed to the caller at drain()
                self._error = self._error or e
            finally:
                del record, array, keep
                self._queue.task_done()


__all__ = ["QUEUE_DEPTH", "StatsWorker"]
