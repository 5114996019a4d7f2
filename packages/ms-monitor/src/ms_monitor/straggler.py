"""Persistent-straggler test: a rank whose busy time stays above its peers', by however little.

The slow-rank rule in ``detect.py`` raises once ``slow_steps`` slow steps in a row have cost
``slow_excess_seconds``. That is fast for a big straggler but slow for a small one: 20 % on 50 ms
steps costs 10 ms a step and is not even a "slow step" at ``slow_ratio=1.3``. This test catches it.

For each rank the last ``W`` (``slow_window``, 15) per-step ratios ``r = busy / median(peers' busy)``
are kept; the rank is a persistent straggler when at least a share ``f`` (``slow_window_fraction``,
0.85, i.e. 13 of 15) of them are ``r >= r0`` (``slow_window_ratio``, 1.08). Put another way, the
``1 - f`` quantile of the window's ratios (its 3rd lowest of 15) is at least ``r0``: a robust location
estimate whose breakdown point is the whole burst budget. A burst counts like any slow step, however
large it is (a 6x step counts exactly like a 1.09x one), and bursts must fill ``f W`` steps of the
window to raise; a steady +20 % is at or above 1.08x in nearly every step.

Why this and not a CUSUM or change-point test: what tells a descheduling burst (3-6x for 3-5 steps
on a loaded host) from a straggler is only how long it lasts, not how large it is (the recorded
straggler is 13x). A one-sided CUSUM on the clipped log-ratio also ends up counting elevated steps,
with a drift, a clip and a threshold to tune together; here two numbers say it directly ("at least
8 % slower than the peers in 13 of the last 15 steps"). Two bursts of one rank with one normal step
between them fill 11 of 15 steps: the normal step and two more must also be elevated by chance.

The cost is latency: a straggler well above ``r0 - 1`` is raised after about ``f W`` = 13 steps (the
steps before its onset are mostly below ``r0``); one near the noise (10 % with 5 % noise) misses
often and is found late or not at all. Large stragglers are raised sooner by the excess rule. The
limit: a rank descheduled in more than ``f`` of a window costs the job as much as a straggler and is
reported as one. ``benchmarks/bench_monitor.py --detector`` measures both sides.
"""

from __future__ import annotations

from collections import deque


class RatioWindow:
    """The last ``size`` busy-time ratios of one rank to its peers' median, and the verdict on them."""

    def __init__(self, size: int):
        self.ratios: deque[float] = deque(maxlen=size)

    def push(self, ratio: float) -> None:
        self.ratios.append(ratio)

    def full(self) -> bool:
        return self.ratios.maxlen is not None and len(self.ratios) == self.ratios.maxlen

    def median(self) -> float:
        ordered = sorted(self.ratios)
        n, mid = len(ordered), len(ordered) // 2
        return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0

    def fraction_at_least(self, ratio: float) -> float:
        """Share of the window's steps in which the rank's busy time was at least ``ratio`` x its peers'."""
        return sum(r >= ratio for r in self.ratios) / len(self.ratios)

    def persistent(self, min_ratio: float, min_fraction: float) -> bool:
        """A full window in which at least ``min_fraction`` of the steps were ``min_ratio`` x the peers."""
        return self.full() and self.fraction_at_least(min_ratio) >= min_fraction
