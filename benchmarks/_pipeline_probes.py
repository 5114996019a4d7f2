"""What bench_pipeline.py measures on each rank besides step times: the peak resident size during
a step, the bytes a stage holds for one microbatch after F and after B, and the one-way latency of
one activation between the two ranks."""

from __future__ import annotations

import statistics
import time

import numpy as np


class PeakRSS:
    """The highest resident set size while the block runs, from the kernel's own high-water mark
    (VmHWM, reset on entry by writing 5 to /proc/self/clear_refs): nothing runs beside the step,
    where a sampling thread would wake on the rank's pinned core every few milliseconds. Where the
    reset is refused, the mark is the process's peak so far."""

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {field}")

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self.start = self._status("VmRSS")
        return self

    def __exit__(self, *exc):
        self.peak = self._status("VmHWM")


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
