"""Agent and daemon in one process: samples arrive, drops are counted, reconnection, tokens, validation."""

import os
import socket
import struct
import urllib.error
import urllib.request

import msgpack
import pytest
from conftest import Ranks, get_json, wait_for

from ms_monitor import Daemon, DaemonConfig, Monitor, MonitorError, wire
from ms_monitor.shipper import read_frame


def test_samples_with_phases_reach_the_daemon(daemon):
    ranks = Ranks(daemon.agent_addrs[0], ranks=(0, 1), step_s=0.01)
    try:
        wait_for(
            lambda: (
                all(r["received"] >= 10 for r in daemon.store.status()["ranks"])
                and len(daemon.store.status()["ranks"]) == 2
            ),
            what="10 samples per rank",
        )
    finally:
        ranks.close()
    for info in daemon.store.ranks.values():
        p = info.window[-1]
        assert p.phases["forward"] >= 0.01 and p.phases["allreduce"] >= 0.001
        assert p.ct == p.phases["allreduce"]  # comm ranges add up to the comm time
        assert p.dt >= p.phases["forward"] + p.phases["allreduce"]
        assert p.tok == 128 and p.hm > 0
    steps = [p.step for p in daemon.store.ranks[0].window]
    assert steps == list(range(1, len(steps) + 1))


def test_drops_and_counts_when_no_daemon(sock_dir):
    mon = Monitor(rank=0, addr=f"unix:{sock_dir}/none.sock", queue_size=10)
    for _ in range(50):
        with mon.step():
            with mon.range("forward"):
                pass
    assert mon.stats()["dropped"] == 40 and mon.stats()["sent"] == 0
    mon.close()


def test_agent_reconnects_after_the_daemon_restarts(tmp_path, sock_dir):
    path = os.path.join(sock_dir, "r.sock")
    ranks = Ranks(f"unix:{path}", ranks=(0,), step_s=0.005)
    try:
        first = Daemon(DaemonConfig(port=None, unix=path, http_port=None, trace_dir=str(tmp_path))).start_in_thread()
        wait_for(lambda: first.store.ranks.get(0) and first.store.ranks[0].received > 5, what="first daemon")
        first.stop()
        stopped_at = ranks.monitors[0].step_num
        second = Daemon(DaemonConfig(port=None, unix=path, http_port=None, trace_dir=str(tmp_path))).start_in_thread()
        try:
            wait_for(
                lambda: second.store.ranks.get(0) and second.store.ranks[0].last_step > stopped_at + 5,
                what="samples after the restart",
            )
        finally:
            second.stop()
        assert ranks.monitors[0].stats()["connects"] == 2
    finally:
        ranks.close()


def test_steps_never_wait_for_a_daemon_that_does_not_read(sock_dir):
    # A "daemon" that says welcome and then never reads: the socket buffers fill up.
    path = os.path.join(sock_dir, "stuck.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    mon = Monitor(rank=0, addr=f"unix:{path}", queue_size=100)
    conn, _ = srv.accept()
    read_frame(conn)  # the hello
    conn.sendall(wire.encode({"t": "welcome", "v": 1}))
    phases = {f"phase{i}": None for i in range(60)}  # big samples fill the buffers sooner
    for _ in range(20000):
        with mon.step():
            for name in phases:
                with mon.range(name):
                    pass
    stats = mon.stats()
    assert mon.step_num == 20000
    assert stats["dropped"] > 0 and stats["sent"] + stats["dropped"] <= 20000
    mon.close(timeout=0.1)
    conn.close()
    srv.close()


def raw_client(addr_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(addr_path)
    return s


def test_daemon_validates_every_message(daemon):
    s = raw_client(daemon.config.unix)
    s.sendall(wire.encode({"t": "hello", "v": 1, "role": "agent", "rank": 2}))
    assert read_frame(s)["t"] == "welcome"
    bad = msgpack.packb({"t": "b", "s": [{"r": 2, "s": 1, "ts": 1.0, "dt": "fast"}]})
    s.sendall(struct.pack(">I", len(bad)) + bad)
    good = [{"r": 2, "s": 1, "ts": 1.0, "dt": 0.1}, {"r": 7, "s": 1, "ts": 1.0, "dt": 0.1}]  # rank 7 is not this agent
    s.sendall(wire.encode({"t": "b", "s": good}))
    wait_for(lambda: daemon.store.received == 1, what="the valid sample")
    assert daemon.store.invalid == 1 and set(daemon.store.ranks) == {2}
    s.sendall(struct.pack(">I", wire.MAX_FRAME + 1))  # an oversized frame closes the connection
    assert s.recv(10) == b""
    wait_for(lambda: not daemon.store.ranks[2].connected, what="disconnect")
    s.close()


def test_token_is_required_when_configured(tmp_path, sock_dir, monkeypatch):
    path = os.path.join(sock_dir, "t.sock")
    d = Daemon(DaemonConfig(port=None, unix=path, http_port=0, token="s3cret", trace_dir=str(tmp_path)))
    d.start_in_thread()
    try:
        s = raw_client(path)
        s.sendall(wire.encode({"t": "hello", "v": 1, "role": "agent", "rank": 0, "token": "wrong"}))
        assert read_frame(s) == {"t": "error", "msg": "bad or missing token"}
        s.close()
        monkeypatch.setenv("MS_MONITOR_TOKEN", "s3cret")
        mon = Monitor(rank=0, addr=f"unix:{path}")
        with mon.step():
            pass
        wait_for(lambda: d.store.received == 1, what="sample with the token")
        mon.close()
        with pytest.raises(urllib.error.HTTPError) as err:
            get_json(d.http_url + "/api/trace", {"steps": 1}, auto_token=False)
        assert err.value.code == 401
        with pytest.raises(urllib.error.HTTPError) as err:  # right token, but nothing to trace: 400, not 401
            get_json(d.http_url + "/api/trace", {"steps": 1, "ranks": [5]}, token="s3cret")
        assert err.value.code == 400
    finally:
        d.stop()


@pytest.mark.parametrize("kw", [{"host": "0.0.0.0"}, {"http_host": "10.0.0.1"}, {"port": None}])
def test_config_refuses_exposed_listeners_without_token(kw):
    with pytest.raises(MonitorError):
        Daemon(DaemonConfig(**kw))


def test_status_and_series_api(daemon):
    # each rank steps a known number of times, so the newest-5 window of every rank is known exactly
    steps = {0: 20, 1: 18, 2: 22}
    for rank, n in steps.items():
        mon = Monitor(rank=rank, world_size=3, addr=daemon.agent_addrs[0])
        for _ in range(n):
            with mon.step(tokens=128):
                with mon.range("forward"):
                    pass
        mon.close()
    wait_for(
        lambda: {r["rank"]: r["received"] for r in get_json(daemon.http_url + "/api/status")["ranks"]} == steps,
        what="every step of the 3 ranks",
    )
    status = get_json(daemon.http_url + "/api/status")
    assert [(r["rank"], r["last_step"]) for r in status["ranks"]] == [(0, 20), (1, 18), (2, 22)]
    series = get_json(daemon.http_url + "/api/series?last=5")
    # the union of each rank's newest 5 steps: 16..20, 14..18 and 18..22
    assert series["ranks"] == [0, 1, 2] and series["steps"] == list(range(14, 23))
    # a rank's row holds every step of its window in that range: 14..20, 14..18, 14..22
    assert [sum(v is not None for v in row) for row in series["step_time"]] == [7, 5, 9]
    page = urllib.request.urlopen(daemon.http_url + "/").read().decode()
    assert "api/series" in page and "<svg" in page
