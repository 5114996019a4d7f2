"""The daemon's configuration and the limits on what its clients may make it hold.

Every bound on something a client controls has a default and an environment variable that raises
it (``ms_layout.limits.Limit``); the daemon flags override them per daemon.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ms_layout.limits import Limit

from . import wire
from .auth import TOKEN_ENV, is_loopback
from .capture import default_trace_root
from .detect import DetectorConfig
from .errors import MonitorError

MAX_RANKS = Limit("MS_MONITOR_MAX_RANKS", 4096, "ranks tracked by one daemon")
MAX_CONNECTIONS = Limit("MS_MONITOR_MAX_CONNECTIONS", 1024, "open agent connections")
MAX_HTTP_BODY = Limit("MS_MONITOR_MAX_HTTP_BODY", 1 << 20, "bytes of an HTTP request body")
MAX_HTTP_CONNECTIONS = Limit("MS_MONITOR_MAX_HTTP_CONNECTIONS", 32, "concurrent HTTP connections")
HTTP_TIMEOUT = Limit("MS_MONITOR_HTTP_TIMEOUT", 10, "seconds an HTTP connection may take to send a request")


def _port(value: int | None, name: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535):
        raise MonitorError(f"{name} = {value!r} is not a port in 0..65535 (0: any free port)")


@dataclass
class DaemonConfig:
    """Where the daemon listens, what it exports and how much it takes from its clients."""

    host: str = "127.0.0.1"
    """host of the agent TCP listener"""
    port: int | None = 7781
    """agent TCP port (0: any free port, None: no TCP listener)"""
    unix: str | None = None
    """path of a Unix socket for agents (mode 0600)"""
    http_host: str = "127.0.0.1"
    """host of the HTTP server (dashboard, /metrics, API)"""
    http_port: int | None = 7780
    """HTTP port (0: any free port, None: no HTTP server)"""
    token: str | None = None
    """shared secret of agents and HTTP commands; required when any listener is beyond loopback"""
    token_file: str | None = None
    """where a daemon without ``token`` writes the one it makes (default ``auth.default_token_file``)"""
    allow_local_unauthenticated: bool = False
    """let HTTP commands from loopback peers through without the token"""
    http_allow_hosts: tuple[str, ...] = ()
    """further names accepted in the Host header (a reverse proxy's)"""
    forward: str | None = None
    """address of a cluster aggregator to relay samples to (``tcp:host:port``)"""
    trace_dir: str = field(default_factory=default_trace_root)
    """where trace jobs write their merged traces"""
    jsonl: str | None = None
    """append every sample and alert as a JSON line to this file"""
    tensorboard: str | None = None
    """write TensorBoard scalars under this directory"""
    window: int = 600
    """samples kept per rank"""
    max_ranks: int = field(default_factory=lambda: MAX_RANKS.value)
    """ranks tracked at most; a new rank beyond it takes the place of a disconnected one or is refused"""
    max_connections: int = field(default_factory=lambda: MAX_CONNECTIONS.value)
    """agent, dyno and relay connections open at once"""
    http_max_body: int = field(default_factory=lambda: MAX_HTTP_BODY.value)
    """bytes of an HTTP request body (413 above)"""
    http_max_connections: int = field(default_factory=lambda: MAX_HTTP_CONNECTIONS.value)
    """HTTP connections served at once (503 above)"""
    http_timeout: float = field(default_factory=lambda: float(HTTP_TIMEOUT.value))
    """seconds of silence after which an HTTP connection is closed (408 in a body)"""
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    """detector thresholds"""
    trace_timeout: float = 180.0
    """seconds after which a trace job finishes with whatever arrived"""
    clean_shm: bool = True
    """remove MindSpore's hook segments (``/dev/shm/DynamicProfileShm*``) that killed jobs left (``shm.py``)"""

    def check(self) -> None:
        _port(self.port, "port")
        _port(self.http_port, "http_port")
        for name in ("window", "max_ranks", "max_connections", "http_max_body", "http_max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MonitorError(f"{name} = {value!r} must be a positive integer")
        if not 0 < self.http_timeout <= 3600:
            raise MonitorError(f"http_timeout = {self.http_timeout!r} must be in (0, 3600] seconds")
        exposed = [
            h
            for h, p in ((self.host, self.port), (self.http_host, self.http_port))
            if p is not None and not is_loopback(h)
        ]
        if exposed and not self.token:
            raise MonitorError(f"listening on {exposed} (beyond loopback) needs a token (--token or {TOKEN_ENV})")
        if self.port is None and self.unix is None:
            raise MonitorError("the daemon needs an agent listener: a TCP port or a Unix socket path")
        if self.forward:
            wire.parse_address(self.forward)
