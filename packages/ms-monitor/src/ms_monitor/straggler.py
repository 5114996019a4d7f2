"""Persistent-straggler test: a rank whose busy time stays above its peers', by however little.

The slow-rank rule in ``detect.py`` raises once ``slow_steps`` slow steps in a row have cost
``slow_excess_seconds``. That is fast for a big straggler but slow for a small one: 20 % on 50 ms
steps costs 10 ms a step and is not even a "slow step" at ``slow_ratio=1.3``. This test catches it.

For each rank the last ``W`` (``slow_window``, 15) per-step ratios ``r = busy / median(peers' busy)``
are kept. The rank is a persistent straggler when, over that window,

* at least a share ``f`` (``slow_window_fraction``, 0.85: 13 of 15) of the ratios are ``r >= r0``
  (``slow_window_ratio``, 1.07). Put another way, the ``1 - f`` quantile of the window (its 3rd
  lowest ratio of 15) is at least ``r0``: a robust location estimate that bursts cannot move unless
  they fill ``f W`` steps, since a 6x step counts exactly like a 1.08x one. A steady +20 % is at
  or above 1.07x in about 98 % of its steps (with 5 % noise); and
* the ratios are steady: the window's median over its lower quartile is at most ``s``
  (``slow_window_spread``, 1.5). A straggler's ratios sit at one level (about 1.05 with 5 % noise,
  also when the host deschedules it for a few steps: those land above the median); bursts that fill
  half the window put 3-6x steps at the median and 1x ones in the lower quartile.

Why this and not a CUSUM or change-point test: what tells a descheduling burst (3-6x for 3-5 steps
on a loaded host) from a straggler is how long it lasts and how steady it is, not how large (the
recorded straggler is 13x). A one-sided CUSUM on the clipped log-ratio ends up counting elevated
steps too, with a drift, a clip and a threshold to tune together; here the numbers say it directly
("at least 7 % slower than the peers in 13 of the last 15 steps, at a steady level"). Two bursts of
one rank with one normal step between them fill 11 of 15 steps, so the count alone would need only
two more elevated steps by chance; the steadiness condition then refuses the window.

The cost is latency: a straggler well above ``r0 - 1`` is raised after about ``f W`` = 13 steps (the
steps before its onset are mostly below ``r0``); one near the noise (10 % with 5 % noise) misses
often and is found late or not at all. Large stragglers are raised sooner by the excess rule. The
limit: a rank descheduled in most of a window, at a steady level, is reported as a straggler (it
costs the job as much as one). ``benchmarks/bench_monitor.py --detector`` measures both sides.
"""

from __future__ import annotations

import math
from collections import deque


class RatioWindow:
    """The last ``size`` busy-time ratios of one rank to its peers' median, and the verdict on them."""

    def __init__(self, size: int):
        self.ratios: deque[float] = deque(maxlen=size)

    def push(self, ratio: float) -> None:
        self.ratios.append(ratio)

    def full(self) -> bool:
        return self.ratios.maxlen is not None and len(self.ratios) == self.ratios.maxlen

    def lower_spread(self) -> float:
        """Median over lower quartile of the window's ratios: about 1 for a steady straggler, even one
        descheduled for a few of the steps; several for bursts that fill half the window or more (3-6x
        steps mixed with 1x ones)."""
        ordered = sorted(self.ratios)
        n = len(ordered)
        low, mid = ordered[n // 4], ordered[n // 2]
        return mid / low if low > 0 else math.inf

    def fraction_at_least(self, ratio: float) -> float:
        """Share of the window's steps in which the rank's busy time was at least ``ratio`` x its peers'."""
        return sum(r >= ratio for r in self.ratios) / len(self.ratios)

    def persistent(self, min_ratio: float, min_fraction: float, max_spread: float = math.inf) -> bool:
        """A full window in which at least ``min_fraction`` of the steps were ``min_ratio`` x the peers,
        and whose ratios are steady: median over lower quartile at most ``max_spread``."""
        return self.full() and self.fraction_at_least(min_ratio) >= min_fraction and self.lower_spread() <= max_spread
