"""The shaped test network: ranks in their own namespaces, links at a set rate, always cleaned up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from ms_layout.comm import netns
from ms_layout.errors import CommError

pytestmark = pytest.mark.needs_torch

NBYTES = 2 << 20  # 2 MiB: 0.17 s one way at 100 Mbit/s, ~1 ms on loopback


def _allreduce_seconds(group, nbytes):
    x = np.ones(nbytes // 4, np.float32)
    group.all_reduce(x)
    group.barrier()
    start = time.perf_counter()
    for _ in range(3):
        group.all_reduce(x)
    seconds = (time.perf_counter() - start) / 3
    np.testing.assert_array_equal(x[:4], np.full(4, 2.0**4, np.float32))  # 1 -> 2 -> ... -> 16
    return seconds


def _where(group):
    import socket

    return os.environ["MS_LAYOUT_NETNS"], socket.gethostbyname(os.environ["MASTER_ADDR"]), group.rank


def _netns_names():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_ranks_run_in_their_namespaces(shaped_network, run_ranks):
    net = shaped_network(2, rate="1gbit")
    assert run_ranks(_where, 2, network=net) == [(net.namespace(r), net.address(0), r) for r in range(2)]


def test_the_link_rate_bounds_an_all_reduce(shaped_network, run_ranks):
    """2 ranks: gloo's all-reduce sends the whole buffer each way, so one takes at least
    bytes * 8 / rate on the shaped link, and far less on loopback."""
    loopback = min(run_ranks(_allreduce_seconds, 2, args=(NBYTES,)))
    net = shaped_network(2, rate="100mbit")
    shaped = min(run_ranks(_allreduce_seconds, 2, args=(NBYTES,), network=net))
    floor = NBYTES * 8 / 100e6
    assert floor * 0.95 <= shaped <= floor * 2.5, (shaped, floor)
    assert loopback < floor / 5, (loopback, floor)


def test_namespaces_are_removed_on_exit_and_on_error(shaped_network):
    with netns.ShapedNetwork(2, rate="1gbit") as net:
        assert net.namespace(0) in _netns_names()
    assert net.tag not in _netns_names()
    with pytest.raises(RuntimeError), netns.ShapedNetwork(1, rate="1gbit") as net:
        raise RuntimeError("test body failed")
    assert net.tag not in _netns_names()


HARNESS = textwrap.dedent(
    """
    import sys, time
    from ms_layout.comm.netns import ShapedNetwork
    with ShapedNetwork(2, rate="1gbit"):
        print("up", flush=True)
        time.sleep(60)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_harness_leaves_nothing_after_the_next_one(shaped_network, sig):
    proc = subprocess.Popen([sys.executable, "-c", HARNESS], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    tag = f"{netns.PREFIX}{proc.pid}"
    assert f"{tag}r0" in _netns_names()
    proc.send_signal(sig)
    proc.wait(timeout=30)
    if sig == signal.SIGTERM:  # its own handler removed them
        assert tag not in _netns_names()
    else:  # SIGKILL: the next harness does
        assert f"{tag}r0" in _netns_names()
        assert sorted(netns.clean_stale()) == sorted([f"{tag}h", f"{tag}r0", f"{tag}r1"])
        assert tag not in _netns_names()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nranks": 0}, "nranks = 0"),
        ({"nranks": True}, "nranks = True"),
        ({"nranks": 2, "rate": "fast"}, "rate = 'fast' is not a tc value"),
        ({"nranks": 2, "rate": "1gbit; reboot"}, "is not a tc value"),
        ({"nranks": 2, "burst": "-1"}, "burst = '-1'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_made(kwargs, message):
    with pytest.raises(CommError, match=message):
        netns.ShapedNetwork(**kwargs)


def test_available_says_why_not(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns.available() == (False, "network namespaces need root (run as root, as CI does)")


def test_rate_for_a_share_of_compute():
    # 512 KiB (4 x 128 tokens x 256 fp32) in a third of a 12 ms layer: 4 ms -> 1048.6 Mbit/s
    assert netns.rate_for(512 * 1024, 0.004) == "1048576kbit"
    with pytest.raises(CommError, match="positive bytes and seconds"):
        netns.rate_for(0, 1.0)


def test_msrun_argv_is_one_node_per_namespace(shaped_network):
    net = shaped_network(3, rate="100mbit")
    argv = net.msrun_argv(2, "train.py", ["--steps", "3"], local_workers=2, port=9000, log_dir="logs")
    assert argv[:4] == ["ip", "netns", "exec", net.namespace(2)]
    assert argv[4] == "msrun" and argv[-3:] == ["train.py", "--steps", "3"]
    flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    assert flags["worker_num"] == "6" and flags["local_worker_num"] == "2" and flags["node_rank"] == "2"
    assert flags["master_addr"] == net.address(0) and flags["master_port"] == "9000"
    assert net.node_env() == {"GLOO_SOCKET_IFNAME": "eth0"}


def test_sent_bytes_counts_what_crossed_the_link(shaped_network):
    net = shaped_network(2, rate="100mbit")
    before = net.sent_bytes(0)
    send = (
        "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
        f"[s.sendto(bytes(1000), ('{net.address(1)}', 9)) for _ in range(3)]"
    )
    subprocess.run(net.exec_argv(0, [sys.executable, "-c", send]), check=True, timeout=30)
    assert net.sent_bytes(0) - before >= 3 * 1000


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda net: net.msrun_argv(5, "x.py"), "node = 5; this network has nodes 0..1"),
        (lambda net: net.msrun_argv(0, "x.py", local_workers=0), "local_workers = 0"),
        (lambda net: net.msrun_argv(0, "x.py", port=80), "port = 80"),
        (lambda net: net.sent_bytes(-1), "node = -1"),
    ],
)
def test_bad_node_arguments_name_the_value(shaped_network, call, message):
    with pytest.raises(CommError, match=message):
        call(shaped_network(2))


def test_a_closed_network_refuses_node_commands():
    with pytest.raises(CommError, match="is not up"):
        netns.ShapedNetwork(2).exec_argv(0, ["true"])


def test_auto_burst_is_four_milliseconds_of_the_rate_at_least_64k():
    assert netns.rate_bits("567585kbit") == 567_585_000
    assert netns.ShapedNetwork(2, rate="567585kbit").bucket == "283792b"
    assert netns.ShapedNetwork(2, rate="100mbit").bucket == "65536b"  # 50 kB in 4 ms: the floor
    assert netns.ShapedNetwork(2, rate="1gbit", burst="32kb").bucket == "32kb"
    with pytest.raises(CommError, match="not a tc rate"):
        netns.rate_bits("fast")
