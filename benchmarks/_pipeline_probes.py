"""What bench_pipeline.py measures on each rank besides step times: the peak resident size during
a step, the bytes a stage holds for one microbatch after F and after B, and the one-way latency of
one activation between the two ranks."""

from __future__ import annotations

import os
import statistics
import threading
import time

import numpy as np


class PeakRSS:
    """The highest resident set size seen while the block runs (sampled every 2 ms)."""

    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self):
        self.start = self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.now())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def held_units(runtime, shape, vocab) -> dict:
    """Bytes one microbatch leaves held on each stage after F and after B (for the simulator's
    memory model), measured on the stages themselves with data of the right shape."""
    import mindspore as ms

    rng = np.random.default_rng(0)
    out = {}
    for s, stage in runtime.stages.items():
        x = (
            ms.Tensor(rng.integers(0, vocab, shape[:2]).astype(np.int32))
            if stage.first
            else ms.Tensor(rng.standard_normal(shape).astype(np.float32))
        )
        labels = ms.Tensor(rng.integers(0, vocab, shape[:2]).astype(np.int32)) if stage.last else None
        y = stage.forward(99, x, labels)
        after_f = stage.held_bytes()
        g = ms.Tensor(0.125, ms.float32) if stage.last else ms.Tensor(np.ones(y.shape, np.float32))
        if stage.dw == "explicit" and "1f1b" in runtime.schedule.name.lower():
            stage.backward_full(99, g)
            after_b = 0
        else:
            stage.backward_input(99, g)
            after_b = stage.held_bytes()
            stage.backward_weight(99)
        out[s] = (after_f, after_b)
    for stage in runtime.stages.values():
        stage.zero_grads()
    return out


def ping_pong(group, shape, rounds=20):
    """One-way latency of one activation between the two ranks (half the median round trip)."""
    buf = np.zeros(shape, np.float32)
    trips = []
    for _ in range(rounds):
        start = time.perf_counter()
        if group.rank == 0:
            group.send(buf, 1)
            group.recv(buf, 1)
        else:
            group.recv(buf, 0)
            group.send(buf, 0)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2
