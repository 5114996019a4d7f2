"""The daemon's HTTP side (standard library ``http.server`` in a thread): dashboard, /metrics, JSON API.

    GET  /                      the live dashboard (one static page polling /api/series)
    GET  /metrics               Prometheus text exposition
    GET  /api/status            ranks (rank, last_step, ...), alerts (rank, kind, ...), traces
    GET  /api/series?last=N     per-rank step times and the ranks x steps matrices
    GET  /api/trace/<id>        a trace job's state
    GET  /api/trace/<id>/merged the merged Chrome trace
    POST /api/trace             {"ranks": [..] | null, "steps": N, "start_step": S | null, ...}

Every request must carry a Host header naming this server (403 otherwise, see ``auth.py``). POST
needs ``Authorization: Bearer <token>`` (401 without it, also on loopback, unless the daemon runs
with ``--allow-local-unauthenticated`` and the client is on loopback), ``Content-Type:
application/json`` (a plain cross-site form cannot send it) and a ``Content-Length`` of at most
``http_max_body`` bytes (400 when malformed, 411 when absent, 413 above). A connection that stays
silent for ``http_timeout`` seconds is closed (408 in the middle of a body); at most
``http_max_connections`` are served at once, the next ones get 503.

The server sees the daemon only through an ``Api`` of plain callables.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Callable
from urllib.parse import parse_qs, urlparse

from .auth import HostCheck, bearer, is_loopback, same_token
from .config import DaemonConfig
from .errors import MonitorError

log = logging.getLogger("ms_monitor.daemon")


@dataclass
class Api:
    """What the HTTP side may do with the daemon: read-only views and one command."""

    status: Callable[[], dict]
    """the /api/status document"""
    series: Callable[[int], dict]
    """the newest N steps per rank (/api/series)"""
    metrics: Callable[[], str]
    """the Prometheus text"""
    trace: Callable[[dict], dict]
    """start a trace job from a request body (thread-safe); raises MonitorError for a bad request"""
    trace_status: Callable[[str], dict | None]
    """a job's summary, None if there is no such job"""
    token: str | None
    """the token POST needs"""
    config: DaemonConfig = field(default_factory=DaemonConfig)
    """the HTTP settings: ``allow_local_unauthenticated``, ``http_allow_hosts``, ``http_max_body``,
    ``http_timeout``, ``http_max_connections``"""


def _dashboard() -> bytes:
    return resources.files("ms_monitor").joinpath("dashboard.html").read_bytes()


class _Refused(Exception):
    """A request answered with an error status."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def make_handler(api: Api, host_ok: HostCheck) -> type[BaseHTTPRequestHandler]:
    cfg = api.config

    class Handler(BaseHTTPRequestHandler):
        server_version = "ms-monitor"
        timeout = cfg.http_timeout  # StreamRequestHandler puts it on the socket: every read waits at most this

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("http: " + fmt, *args)

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            if code >= 400 and self.command == "POST":
                self.send_header("Connection", "close")  # the body may be unread: do not parse it as a request
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, obj: Any) -> None:
            self._send(code, json.dumps(obj).encode(), "application/json")

        def _serve(self, fn: Callable[[], None]) -> None:
            try:
                if not host_ok(self.headers.get("Host")):
                    raise _Refused(403, f"Host {self.headers.get('Host')!r} does not name this server")
                fn()
            except _Refused as exc:
                self._json(exc.code, {"error": str(exc)})
            except (ValueError, MonitorError) as exc:
                self._json(400, {"error": str(exc)})
            except (ConnectionError, socket.timeout):
                self.close_connection = True
            except Exception as exc:  # a bug: answer, log, keep serving
                log.exception("ms-monitor http: %s %s failed", self.command, self.path)
                self._json(500, {"error": f"internal error: {type(exc).__name__}"})

        def do_GET(self) -> None:
            self._serve(self._get)

        def do_POST(self) -> None:
            self._serve(self._post)

        def _get(self) -> None:
            url = urlparse(self.path)
            path = url.path.rstrip("/") or "/"
            if path in ("/", "/dashboard"):
                self._send(200, _dashboard(), "text/html; charset=utf-8")
            elif path == "/metrics":
                self._send(200, api.metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/api/status":
                self._json(200, api.status())
            elif path == "/api/series":
                last = parse_qs(url.query).get("last", ["200"])[0]
                if not re.fullmatch(r"[0-9]{1,9}", last):
                    raise MonitorError(f"last={last!r} is not a number of steps")
                self._json(200, api.series(max(1, min(int(last), 5000))))
            elif path.startswith("/api/trace/"):
                self._trace_get(path[len("/api/trace/") :])
            else:
                raise _Refused(404, f"no such path {path!r}")

        def _trace_get(self, rest: str) -> None:
            job_id, _, what = rest.partition("/")
            job = api.trace_status(job_id)
            if job is None:
                raise _Refused(404, f"no trace {job_id!r}")
            if what == "merged":
                if job["path"] is None:
                    self._json(409, {"error": f"trace {job_id} is {job['state']}", "state": job["state"]})
                else:
                    with open(job["path"], "rb") as f:
                        self._send(200, f.read(), "application/json")
            else:
                self._json(200, job)

        def _post(self) -> None:
            path = urlparse(self.path).path.rstrip("/")
            if path != "/api/trace":
                raise _Refused(404, f"no such path {path!r}")
            local = cfg.allow_local_unauthenticated and is_loopback(self.client_address[0])
            given = bearer(self.headers.get("Authorization"))
            if not local and not (api.token and given and same_token(given, api.token)):
                raise _Refused(401, "trace needs 'Authorization: Bearer <token>' (the daemon's --token or token file)")
            if not self.headers.get("Content-Type", "").startswith("application/json"):
                raise _Refused(415, "send the request as application/json")
            try:
                req = json.loads(self._body())
            except RecursionError:
                raise MonitorError("the request nests its JSON too deeply") from None
            if not isinstance(req, dict):
                raise MonitorError("the request must be a JSON object")
            self._json(200, api.trace(req))

        def _body(self) -> bytes:
            lengths = self.headers.get_all("Content-Length") or []
            if not lengths:
                raise _Refused(411, "a POST needs a Content-Length header")
            if len(set(lengths)) > 1 or not re.fullmatch(r"[0-9]{1,18}", lengths[0].strip()):
                raise _Refused(400, f"Content-Length {', '.join(lengths)!r} is not a number of bytes")
            length = int(lengths[0])
            if length > cfg.http_max_body:
                raise _Refused(
                    413,
                    f"request body of {length} bytes is over the limit of {cfg.http_max_body} "
                    "(raise it with MS_MONITOR_MAX_HTTP_BODY=N)",
                )
            if length == 0:
                raise _Refused(400, "the request body is empty; expected a JSON object")
            try:
                data = self.rfile.read(length)
            except socket.timeout:
                raise _Refused(408, f"the request body did not arrive within {cfg.http_timeout:g} s") from None
            if len(data) < length:
                raise _Refused(400, f"the request body ended after {len(data)} of {length} bytes")
            return data

    return Handler


class Server(ThreadingHTTPServer):
    """A threading HTTP server that serves at most ``max_connections`` connections at once."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst of clients is accepted (and answered), not stalled

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int):
        self._slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            body = json.dumps({"error": f"the daemon serves {self.max_connections} HTTP connections at once"})
            try:
                request.settimeout(1.0)
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def start_http(api: Api, host: str, port: int) -> Server:
    cfg = api.config
    server = Server((host, port), BaseHTTPRequestHandler, cfg.http_max_connections)  # bind first: port may be 0
    server.RequestHandlerClass = make_handler(api, HostCheck(host, server.server_address[1], cfg.http_allow_hosts))
    threading.Thread(target=server.serve_forever, name="ms-monitor-http", daemon=True).start()
    return server
