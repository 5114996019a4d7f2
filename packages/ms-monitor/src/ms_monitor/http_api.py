"""The daemon's HTTP side (standard library ``http.server`` in a thread): dashboard, /metrics, JSON API.

    GET  /                      the live dashboard (one static page polling /api/series)
    GET  /metrics               Prometheus text exposition
    GET  /api/status            ranks (rank, last_step, ...), alerts (rank, kind, ...), traces
    GET  /api/series?last=N     per-rank step times and the ranks x steps matrices
    GET  /api/trace/<id>        a trace job's state
    GET  /api/trace/<id>/merged the merged Chrome trace
    POST /api/trace             {"ranks": [..] | null, "steps": N, "start_step": S | null, ...}

POST needs ``Content-Type: application/json`` (a plain cross-site form cannot send it) and, when
the daemon has a token, ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

from .errors import MonitorError
from .exporters import prometheus_text

if TYPE_CHECKING:
    from .daemon import Daemon

log = logging.getLogger("ms_monitor.daemon")
MAX_BODY = 64 * 1024


def _dashboard() -> bytes:
    return resources.files("ms_monitor").joinpath("dashboard.html").read_bytes()


def make_handler(daemon: Daemon) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "ms-monitor"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("http: " + fmt, *args)

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, obj: Any) -> None:
            self._send(code, json.dumps(obj).encode(), "application/json")

        def do_GET(self) -> None:
            url = urlparse(self.path)
            path = url.path.rstrip("/") or "/"
            try:
                if path in ("/", "/dashboard"):
                    self._send(200, _dashboard(), "text/html; charset=utf-8")
                elif path == "/metrics":
                    self._send(200, prometheus_text(daemon.store).encode(), "text/plain; version=0.0.4; charset=utf-8")
                elif path == "/api/status":
                    status = daemon.store.status()
                    status["traces"] = daemon.on_loop(lambda: [j.summary() for j in daemon.traces.jobs.values()])
                    status["agent_addrs"] = daemon.agent_addrs
                    status["forward_dropped"] = daemon.relay.dropped if daemon.relay else 0
                    self._json(200, status)
                elif path == "/api/series":
                    last = int(parse_qs(url.query).get("last", ["200"])[0])
                    self._json(200, daemon.store.series(max(1, min(last, 5000))))
                elif path.startswith("/api/trace/"):
                    self._trace_get(path[len("/api/trace/") :])
                else:
                    self._json(404, {"error": f"no such path {path!r}"})
            except (ValueError, MonitorError) as exc:
                self._json(400, {"error": str(exc)})

        def _trace_get(self, rest: str) -> None:
            job_id, _, what = rest.partition("/")
            job = daemon.on_loop(lambda: daemon.trace_status(job_id))
            if job is None:
                self._json(404, {"error": f"no trace {job_id!r}"})
            elif what == "merged":
                if job["path"] is None:
                    self._json(409, {"error": f"trace {job_id} is {job['state']}", "state": job["state"]})
                else:
                    with open(job["path"], "rb") as f:
                        self._send(200, f.read(), "application/json")
            else:
                self._json(200, job)

        def do_POST(self) -> None:
            path = urlparse(self.path).path.rstrip("/")
            if path != "/api/trace":
                self._json(404, {"error": f"no such path {path!r}"})
                return
            token = daemon.config.token
            given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if token and not hmac.compare_digest(given, token):
                self._json(401, {"error": "this daemon needs 'Authorization: Bearer <token>' for trace"})
                return
            if not self.headers.get("Content-Type", "").startswith("application/json"):
                self._json(415, {"error": "send the request as application/json"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY:
                self._json(400, {"error": f"request body of {length} bytes; expected 1..{MAX_BODY}"})
                return
            try:
                req = json.loads(self.rfile.read(length))
                if not isinstance(req, dict):
                    raise MonitorError("the request must be a JSON object")
                self._json(200, daemon.request_trace(req))
            except (ValueError, MonitorError) as exc:
                self._json(400, {"error": str(exc)})

    return Handler


def start_http(daemon: Daemon, host: str, port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(daemon))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="ms-monitor-http", daemon=True).start()
    return server
