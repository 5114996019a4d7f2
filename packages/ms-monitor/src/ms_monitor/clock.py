"""Clock offsets of the ranks against the daemon, for aligning the merged traces of several hosts.

Cristian's algorithm (Cristian 1989, "Probabilistic clock synchronization"): the daemon sends
``ping`` with its wall clock ``d`` (t0); the client answers at once with ``pong`` carrying ``d``
and its own wall clock ``a`` at receipt; the daemon receives it at t1. If the client read its
clock somewhere inside the round trip, its offset (client clock minus daemon clock) is

    offset = a - (t0 + t1) / 2,   |error| <= (t1 - t0) / 2

so of the last few probes the one with the shortest round trip gives the estimate and its bound
(as NTP's clock filter does: queueing only ever lengthens a round trip). The daemon probes every
connection each tick; a trace merge shifts each rank's events by ``-offset`` onto the daemon's
clock and records what it applied.

Ranks behind a relay are two hops away: their offset is the relay's own offset against the
aggregator plus the rank's offset against the relay (sent with the rank's ``tdone``), and the
error bounds add.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

#: probes kept per rank; the shortest round trip among them is used
KEEP = 32


@dataclass(frozen=True)
class Offset:
    """A clock's offset against the daemon's."""

    offset: float
    """seconds: the rank's wall clock minus the daemon's"""
    error: float
    """seconds: the bound on |estimate - true offset| (half the round trip used)"""
    samples: int
    """probes the estimate was chosen from"""

    def plus(self, other: Offset) -> Offset:
        """This offset followed by another hop (a rank behind a relay)."""
        return Offset(self.offset + other.offset, self.error + other.error, min(self.samples, other.samples))

    def as_dict(self) -> dict:
        us = {"offset_us": round(self.offset * 1e6, 1), "error_us": round(self.error * 1e6, 1)}
        return {**us, "probes": self.samples}


def estimate(probes: list[tuple[float, float, float]]) -> Offset | None:
    """``[(t0, a, t1), ...]`` (daemon send, client clock, daemon receive) -> the offset of the
    probe with the shortest round trip, or None without a usable probe."""
    good = [(t1 - t0, a - (t0 + t1) / 2) for t0, a, t1 in probes if t1 >= t0]
    if not good:
        return None
    rtt, offset = min(good)
    return Offset(offset, rtt / 2, len(good))


class Clocks:
    """The daemon's probes per rank (and per host, for ranks known only by their host)."""

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self.probes: dict[int, deque] = {}
        self.hosts: dict[int, str] = {}
        self.relayed: dict[int, Offset] = {}
        """offsets of ranks behind relays: the relay's plus the rank's against the relay"""

    def observe(self, rank: int, host: str, t0: float, a: float, t1: float) -> None:
        self.probes.setdefault(rank, deque(maxlen=self.keep)).append((t0, a, t1))
        if host:
            self.hosts[rank] = host

    def offset(self, rank: int) -> Offset | None:
        """The rank's own estimate, else that of another rank on its host (one clock per host)."""
        own = self.probes.get(rank)
        if own:
            return estimate(list(own))
        host = self.hosts.get(rank)
        if host:
            peers = [estimate(list(self.probes[r])) for r, h in self.hosts.items() if h == host and self.probes.get(r)]
            peers = [p for p in peers if p is not None]
            if peers:
                return min(peers, key=lambda p: p.error)
        return None

    def forget(self, rank: int) -> None:
        self.probes.pop(rank, None)

    def observe_relayed(self, rank: int, hop: list[tuple[float, float, float]], tdone: dict) -> None:
        """A relayed rank's offset from its ``tdone``: the relay's offset against this daemon (from
        `hop`, the relay connection's probes) plus the rank's against the relay (``clk``, ``clke``)."""
        relay = estimate(hop)
        if relay is None or "clk" not in tdone:  # the relay did not measure the rank: unknown, not aligned
            self.relayed.pop(rank, None)
            return
        self.relayed[rank] = relay.plus(Offset(tdone["clk"], tdone.get("clke", 0.0), 1))

    def aligned(self, rank: int) -> Offset | None:
        """The rank's clock minus the daemon's, if probes measured it (directly or through a relay)."""
        return self.relayed.get(rank) or self.offset(rank)
