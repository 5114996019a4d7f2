"""A shaped test network on one host: each rank in its own network namespace, links with a set rate.

On one machine, loopback makes communication free, so an overlap of communication and compute can
be neither shown nor disproved. ``ShapedNetwork(n, rate="200mbit")`` builds, with ``ip`` and
``tc``::

    namespace msl<PID>r0 (eth0 10.213.0.1) --veth-- +            + --veth-- msl<PID>r1 (eth0 10.213.0.2)
                                                    | bridge br0 |
    ...                                             + in msl<PID>h + ...

Every rank's link is shaped by a ``tbf`` qdisc at `rate` in both directions (on the rank's egress
and on the bridge port's egress towards it), like a switch with ports of that speed. Latency is
not available (``netem`` is missing from many kernels); only the rate. Addresses exist only inside
the namespaces the harness created; nothing in the host's own namespace changes.

``run_local(fn, n, network=net)`` starts each rank inside its namespace (``setns`` before anything
opens a socket) with gloo bound to ``eth0`` and the rendezvous at rank 0's address. The
namespaces are removed on exit, on an exception, on SIGTERM, at interpreter exit, and, for a
harness killed with SIGKILL, by the next one (names carry the creator's pid).

The same namespaces serve as hosts of a multi-node job: ``net.msrun_argv(node, script, args)``
is MindSpore's ``msrun`` with its multi-node arguments (``--node_rank``, ``--master_addr`` = node
0's address, one node per namespace), run inside that node's namespace with ``ip netns exec``;
``net.node_env()`` binds gloo to the node's ``eth0``. ``net.sent_bytes(node)`` reads the node's
egress counter from tc, so a test can check that its traffic crossed the shaped link.

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and the ``ip`` and ``tc`` tools; ``available()`` says
why not where it cannot run.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

from ms_layout.errors import CommError

PREFIX = "msl"
"""Namespace names are ``msl<PID>h`` (the bridge) and ``msl<PID>r<RANK>``."""
SUBNET = "10.213.0"
"""The /24 of the ranks' addresses (inside the harness's namespaces only)."""
IFNAME = "eth0"
"""The ranks' interface name, for GLOO_SOCKET_IFNAME."""
_CLONE_NEWNET = 0x40000000
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit)$")


_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(rate: str) -> float:
    """A tc rate (``200mbit``) in bits per second."""
    m = _RATE.match(rate) if isinstance(rate, str) else None
    if m is None:
        raise CommError(f"rate = {rate!r:.50} is not a tc rate (for example 200mbit, 1gbit, 500kbit)")
    return float(rate[: -len(m.group(2))]) * _RATE_UNITS[m.group(2)]


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise CommError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done


def _tc(ns: str, *args: str) -> None:
    cmd = ["ip", "netns", "exec", ns, "tc", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise CommError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


def available() -> tuple[bool, str]:
    """Whether a shaped network can be built here, and the reason where not."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces need root (run as root, as CI does)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}probe"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return False, f"cannot create a network namespace: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


def _names() -> list[str]:
    done = _ip("netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def clean_stale() -> list[str]:
    """Remove the namespaces of harnesses whose process is gone; returns their names."""
    removed = []
    for name in _names():
        m = re.match(rf"^{PREFIX}(\d+)(h|r\d+|probe)$", name)
        if not m:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


def enter(namespace: str) -> None:
    """Move the calling thread (call it first thing in a fresh process) into `namespace`."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise CommError(f"setns into {namespace!r} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class ShapedNetwork:
    """N ranks, each in its own network namespace, on a bridge whose every port runs at `rate`."""

    nranks: int
    """Number of rank namespaces."""
    rate: str = "1gbit"
    """tbf rate of every link and direction, in tc's units: 100mbit, 1gbit, 500kbit."""
    burst: str = "auto"
    """tbf bucket size, or "auto": what the link sends in 4 ms, at least 64 KiB. A small bucket
    makes tbf throttle TCP in short bursts, and the kernel's work for them is charged to the
    ranks' own cores (measured, 567.6 Mbit/s, 1 MiB all-reduce between 2 ranks: with 64kb, 20 ms
    wall and about 10 ms of system CPU per rank, a 20 ms matmul loop beside it took 33-36 ms;
    with 256kb, 15 ms wall and about 1 ms of system CPU; the wire time is 14.8 ms)."""
    queue_latency: str = "400ms"
    """How long tbf queues packets before dropping; long, so that TCP backs off without loss."""
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    """Prefix of the namespace names (the creator's pid, for the stale cleanup)."""
    up: bool = False
    """Whether the namespaces exist now."""
    _sigterm: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.nranks, bool) or not isinstance(self.nranks, int) or not 1 <= self.nranks <= 250:
            raise CommError(f"nranks = {self.nranks!r}; a shaped network holds 1 to 250 ranks")
        for name in ("rate", "burst", "queue_latency"):
            value = getattr(self, name)
            if name == "burst" and value == "auto":
                continue
            pattern = _RATE if name == "rate" else re.compile(r"^\d+(\.\d+)?[a-z]*$")
            if not isinstance(value, str) or not pattern.match(value):
                raise CommError(f"{name} = {value!r} is not a tc value (for example 200mbit, 64kb, 400ms)")

    @property
    def bucket(self) -> str:
        """The tbf burst in use: ``burst``, or for "auto" 4 ms of the rate, at least 64 KiB."""
        if self.burst != "auto":
            return self.burst
        return f"{max(64 * 1024, round(rate_bits(self.rate) / 8 * 0.004))}b"

    @property
    def hub(self) -> str:
        """The namespace that holds the bridge."""
        return f"{self.tag}h"

    def namespace(self, rank: int) -> str:
        """The network namespace of `rank`."""
        return f"{self.tag}r{rank}"

    def address(self, rank: int) -> str:
        """The IPv4 address of `rank` (on its eth0)."""
        return f"{SUBNET}.{rank + 1}"

    def rank_env(self, rank: int) -> dict[str, str]:
        """What a rank's environment needs: gloo on eth0, the rendezvous at rank 0."""
        return {"MASTER_ADDR": self.address(0), "GLOO_SOCKET_IFNAME": IFNAME, "MS_LAYOUT_NETNS": self.namespace(rank)}

    def node_env(self) -> dict[str, str]:
        """What a process started in a node's namespace needs besides its launcher's variables."""
        return {"GLOO_SOCKET_IFNAME": IFNAME}

    def exec_argv(self, node: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the namespace of `node` (``ip netns exec``; needs the network up)."""
        self._check_node(node)
        return ["ip", "netns", "exec", self.namespace(node), *argv]

    def msrun_argv(
        self,
        node: int,
        script: str | os.PathLike,
        args: Sequence[str] = (),
        *,
        local_workers: int = 1,
        port: int = 8118,
        log_dir: str | os.PathLike = "msrun_log",
        cluster_timeout: int = 600,
    ) -> list[str]:
        """MindSpore's ``msrun`` for `node` of a job with one node per namespace: ``local_workers``
        workers here, ``nranks * local_workers`` in all, the scheduler at node 0's address."""
        if isinstance(local_workers, bool) or not isinstance(local_workers, int) or local_workers < 1:
            raise CommError(f"local_workers = {local_workers!r}; a node runs at least 1 worker")
        if isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65534:
            raise CommError(f"port = {port!r}; the scheduler port is 1024..65534 (gloo's store uses port + 1)")
        msrun = [
            "msrun", f"--worker_num={self.nranks * local_workers}", f"--local_worker_num={local_workers}",
            f"--master_addr={self.address(0)}", f"--master_port={port}", f"--node_rank={node}",
            f"--log_dir={os.fspath(log_dir)}", "--join=True", f"--cluster_time_out={int(cluster_timeout)}",
            os.fspath(script), *args,
        ]  # fmt: skip
        return self.exec_argv(node, msrun)

    def sent_bytes(self, node: int) -> int:
        """Bytes `node` has sent over its shaped link so far (tc's counter on its eth0)."""
        self._check_node(node)
        done = subprocess.run(
            ["ip", "netns", "exec", self.namespace(node), "tc", "-s", "qdisc", "show", "dev", IFNAME],
            capture_output=True,
            text=True,
        )
        m = re.search(r"Sent (\d+) bytes", done.stdout)
        if done.returncode != 0 or m is None:
            raise CommError(f"no tc counter for node {node}: {done.stderr.strip() or done.stdout.strip()}")
        return int(m.group(1))

    def _check_node(self, node: int) -> None:
        if not self.up:
            raise CommError(f"{self!r} is not up (enter it first)")
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.nranks:
            raise CommError(f"node = {node!r}; this network has nodes 0..{self.nranks - 1}")

    def __enter__(self) -> ShapedNetwork:
        ok, why = available()
        if not ok:
            raise CommError(f"no shaped network: {why}")
        clean_stale()
        atexit.register(self.close)
        if _main_thread() and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _on_sigterm(self, signum, frame) -> None:
        self.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def _build(self) -> None:
        self.up = True
        _ip("netns", "add", self.hub)
        _ip("link", "add", "br0", "type", "bridge", ns=self.hub)
        _ip("link", "set", "br0", "up", ns=self.hub)
        for rank in range(self.nranks):
            ns, port = self.namespace(rank), f"p{rank}"
            _ip("netns", "add", ns)
            _ip("link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.hub)
            _ip("link", "set", port, "master", "br0", ns=self.hub)
            _ip("link", "set", port, "up", ns=self.hub)
            _ip("addr", "add", f"{self.address(rank)}/24", "dev", IFNAME, ns=ns)
            _ip("link", "set", IFNAME, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            for where, dev in ((ns, IFNAME), (self.hub, port)):
                _tc(where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", self.bucket,
                    "latency", self.queue_latency)  # fmt: skip

    def close(self) -> None:
        """Remove every namespace of this network (idempotent)."""
        if not self.up:
            return
        self.up = False
        for name in [self.namespace(r) for r in range(self.nranks)] + [self.hub]:
            _ip("netns", "del", name, check=False)

    def __exit__(self, *exc) -> None:
        self.close()
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        if self._sigterm is not None and _main_thread():
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def rate_for(nbytes: int, seconds: float) -> str:
    """The tc rate at which `nbytes` cross one link in `seconds` (to set communication to a chosen
    share of a measured compute time: ``rate_for(all_reduce_bytes, share * layer_seconds)``)."""
    if not nbytes > 0 or not seconds > 0:
        raise CommError(f"rate_for needs positive bytes and seconds, got {nbytes!r} and {seconds!r}")
    return f"{max(1, round(nbytes * 8 / seconds / 1e3))}kbit"
