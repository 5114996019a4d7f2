"""Who may command the daemon: the token, its file, and the Host header check of the HTTP side.

Every state-changing HTTP call (``POST /api/trace``, which reaches the agents) needs
``Authorization: Bearer <token>``, also on loopback: any local user, or a web page through DNS
rebinding, could otherwise start profilers. A daemon started without ``--token`` makes one
(``secrets.token_urlsafe``) and writes it, mode 0600, to ``token-<http port>`` in the state folder
(``$MS_MONITOR_STATE_DIR``, else ``$XDG_CACHE_HOME/ms-monitor``, else ``~/.cache/ms-monitor``, or
``--token-file``); ``ms-monitor trace`` and ``status`` read it from there for a loopback URL. Tokens
are compared as UTF-8 bytes, so any text a client sends is a wrong token, never an exception.

The Host header must name the address the server is bound to (``localhost``, a loopback address,
the bind host, or for a wildcard bind this machine's names and any IP literal), with the bound
port when a port is given: a page of ``attacker.example`` whose name was rebound to 127.0.0.1
sends ``Host: attacker.example`` and gets 403.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import os
import secrets
import socket
from urllib.parse import urlparse

from ms_layout.files import FileError, atomic_write, read_capped

from .errors import MonitorError

TOKEN_ENV = "MS_MONITOR_TOKEN"
STATE_DIR_ENV = "MS_MONITOR_STATE_DIR"
WILDCARD = ("", "0.0.0.0", "::")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a listener on this machine ("" and 0.0.0.0 mean every interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def state_dir() -> str:
    """Where the daemon writes its generated token (see the module docstring)."""
    if os.environ.get(STATE_DIR_ENV):
        return os.environ[STATE_DIR_ENV]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "ms-monitor")


def default_token_file(port: int) -> str:
    return os.path.join(state_dir(), f"token-{port}")


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_token(path: str, token: str) -> None:
    """Write the token readable by this user only (the folder 0700, the file 0600), atomically."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    atomic_write(path, token + "\n", mode=0o600)


def remove_token(path: str, token: str) -> None:
    """Remove the token file at shutdown, unless another daemon has written its own there since."""
    with contextlib.suppress(OSError, FileError, MonitorError):
        if read_token(path) == token:
            os.unlink(path)


def read_token(path: str) -> str | None:
    """The token in a token file; None when there is no such file."""
    if not os.path.exists(path):
        return None
    try:
        text = read_capped(path, 4096, "token file").decode("utf-8").strip()
    except UnicodeDecodeError:
        raise MonitorError(f"token file {path!r} is not UTF-8 text") from None
    if not text:
        raise MonitorError(f"token file {path!r} is empty")
    return text


def token_for_url(url: str, token_file: str | None = None) -> str | None:
    """The token a CLI call sends: ``MS_MONITOR_TOKEN``, else the given token file, else the default
    token file of a loopback URL's port (a remote daemon's token is never read from this machine)."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if token_file:
        token = read_token(token_file)
        if token is None:
            raise MonitorError(f"token file {token_file!r} does not exist")
        return token
    parts = urlparse(url)
    try:
        port = parts.port or 80
    except ValueError:
        return None
    if parts.hostname is None or not is_loopback(parts.hostname):
        return None
    return read_token(default_token_file(port))


def same_token(given: str, expected: str) -> bool:
    """Constant-time comparison of text tokens (as bytes: non-ASCII text is a wrong token, not a TypeError)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


def bearer(header: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header ("" without one)."""
    scheme, _, value = (header or "").strip().partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


class HostCheck:
    """Whether a request's Host header names this server (see the module docstring)."""

    def __init__(self, bind_host: str, port: int, extra: tuple[str, ...] = ()):
        self.port = str(port)
        self.wildcard = bind_host in WILDCARD
        self.names = {"localhost", bind_host.lower().strip("[]")}
        if self.wildcard:  # resolved once here: getfqdn may ask DNS
            self.names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        self.extra = {h.lower() for h in extra}  # names of a proxy in front, any port

    def __call__(self, header: str | None) -> bool:
        if header is None:
            return True  # no browser sends a request without Host; HTTP/1.0 tools may
        name, port = _split_host(header.strip().lower())
        if name is None:
            return False
        if name in self.extra:
            return True
        if port is not None and port != self.port:
            return False
        if name in self.names or is_loopback(name):
            return True
        if self.wildcard:
            with contextlib.suppress(ValueError):
                ipaddress.ip_address(name)
                return True  # a literal address cannot be rebound
        return False


def _split_host(header: str) -> tuple[str | None, str | None]:
    """``name[:port]`` or ``[v6]:port`` -> (name, port or None); (None, None) when malformed."""
    if header.startswith("["):
        name, sep, rest = header[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None, None
        return name, rest[1:] or None
    if header.count(":") > 1:
        return header, None  # a bare IPv6 address
    name, _, port = header.partition(":")
    return (name or None), (port or None)
