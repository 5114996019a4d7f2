"""Hostile and careless input: what the daemon, its HTTP side, its readers and the CLI answer.

Each case asserts one exact outcome: an HTTP status, an error reply, a counter, a bound on memory, or
for the CLI exit code 2 with one line on stderr that names the bad value.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

import msgpack
import pytest
from conftest import raw_http, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ms_layout.files import FileError, verify_manifest
from ms_monitor import Daemon, DaemonConfig, MonitorError, WireError, wire
from ms_monitor.auth import HostCheck, bearer, default_token_file, read_token, same_token
from ms_monitor.shipper import read_frame
from ms_monitor.store import Store
from ms_monitor.trace_merge import events_from_cpu_timestamps, events_from_trace_view, merge

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def port_of(daemon):
    return int(daemon.http_url.rsplit(":", 1)[1])


def post(daemon, body=b'{"steps": 1}', token=None, host=None, headers=b"", length=None):
    """A POST /api/trace as raw bytes (so a header can hold anything); returns (status, JSON answer)."""
    host = f"127.0.0.1:{port_of(daemon)}" if host is None else host
    head = f"POST /api/trace HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n".encode()
    if token is not None:
        head += b"Authorization: Bearer " + (token.encode() if isinstance(token, str) else token) + b"\r\n"
    if length is not False:
        head += f"Content-Length: {len(body) if length is None else length}\r\n".encode()
    return raw_http(port_of(daemon), head + headers + b"\r\n" + body)


def agent(path, rank=0, **hello):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    s.sendall(wire.encode({"t": "hello", "v": 1, "role": "agent", "rank": rank, **hello}))
    return s, read_frame(s)


# ------------------------------------------------------------------------------------ HTTP commands
def test_a_made_token_is_written_0600_and_required(daemon, state_dir):
    path = default_token_file(port_of(daemon))
    assert daemon.token_file == path and read_token(path) == daemon.token
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(state_dir).st_mode) & 0o077 == 0
    assert post(daemon) == (
        401,
        {"error": "trace needs 'Authorization: Bearer <token>' (the daemon's --token or token file)"},
    )
    assert post(daemon, token="wrong")[0] == 401
    assert post(daemon, token="tökén".encode())[0] == 401  # UTF-8 bytes in the header: 401, not a TypeError
    assert post(daemon, token=b"\xff\xfe")[0] == 401
    assert post(daemon, token=daemon.token) == (400, {"error": "no connected rank matches ranks=None"})


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:80", "127.0.0.1.nip.io", "[::1", "evil:x"])
def test_a_foreign_host_header_is_403(daemon, host):
    status, answer = post(daemon, token=daemon.token, host=host)
    assert status == 403 and answer == {"error": f"Host {host!r} does not name this server"}
    head = f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()  # reads too: a rebound page learns nothing
    assert raw_http(port_of(daemon), head)[0] == 403


def test_host_names_of_this_server_pass(daemon):
    port = port_of(daemon)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", "127.0.0.5"):
        assert raw_http(port, f"GET /api/status HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())[0] == 200, host
    assert raw_http(port, f"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1:{port + 1}\r\n\r\n".encode())[0] == 403


def test_allow_local_unauthenticated_lets_loopback_trace(tmp_path, sock_dir):
    unix = os.path.join(sock_dir, "open.sock")
    d = Daemon(
        DaemonConfig(port=None, unix=unix, http_port=0, allow_local_unauthenticated=True, trace_dir=str(tmp_path))
    ).start_in_thread()
    try:
        s, welcome = agent(unix, rank=0)
        assert welcome["t"] == "welcome"
        status, job = post(d, b'{"steps": 2, "start_step": 100, "profiler": false}')
        assert status == 200 and job["expected"] == [0] and job["start_step"] == 100
        assert read_frame(s)["t"] == "trace"  # the command reached the agent
        assert post(d, host="attacker.example")[0] == 403  # the Host check still holds
        s.close()
    finally:
        d.stop()


@pytest.mark.parametrize(
    "length, body, status, error",
    [
        ("abc", b"{}", 400, "Content-Length 'abc' is not a number of bytes"),
        ("-5", b"{}", 400, "Content-Length '-5' is not a number of bytes"),
        ("0", b"", 400, "the request body is empty; expected a JSON object"),
        (False, b"{}", 411, "a POST needs a Content-Length header"),
        (
            str(2 << 20),
            b"",
            413,
            f"request body of {2 << 20} bytes is over the limit of {1 << 20} "
            "(raise it with MS_MONITOR_MAX_HTTP_BODY=N)",
        ),
        (None, b"[1, 2]", 400, "the request must be a JSON object"),
        (None, b"\xff{", 400, None),
        (None, b"[" * 100000, 400, None),
    ],
)
def test_malformed_bodies_get_an_answer(daemon, length, body, status, error):
    got, answer = post(daemon, body, token=daemon.token, length=length)
    assert got == status and (error is None or answer == {"error": error})


def test_stalled_bodies_time_out_and_connections_are_bounded(tmp_path, sock_dir):
    d = Daemon(
        DaemonConfig(
            port=None,
            unix=os.path.join(sock_dir, "st.sock"),
            http_port=0,
            http_timeout=2.0,
            http_max_connections=8,
            trace_dir=str(tmp_path),
        )
    ).start_in_thread()
    try:
        threads_before = threading.active_count()
        head = "POST /api/trace HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        head += f"Authorization: Bearer {d.token}\r\nContent-Length: 100\r\n\r\n" + '{"steps": '
        t0 = time.monotonic()
        socks = [socket.create_connection(("127.0.0.1", port_of(d)), timeout=10) for _ in range(20)]
        for s in socks:
            s.sendall(head.encode())  # a 503 may already be on its way: the server does not wait for requests
        answers = [s.recv(4096).split(b" ", 2)[1] for s in socks]  # each gets an answer, none hangs
        took = time.monotonic() - t0
        peak = threading.active_count()
        for s in socks:
            s.close()
        assert sorted(answers) == [b"408"] * 8 + [b"503"] * 12 and took < 10
        assert peak - threads_before <= 8  # one thread per served connection, no more
        assert post(d, token=d.token)[0] == 400  # and it serves again
    finally:
        d.stop()


# ------------------------------------------------------------------------------------ agent side
def test_a_non_ascii_agent_token_is_refused(tmp_path, sock_dir):
    unix = os.path.join(sock_dir, "tok.sock")
    d = Daemon(DaemonConfig(port=None, unix=unix, http_port=None, token="s3cret", trace_dir=str(tmp_path)))
    d.start_in_thread()
    try:
        s, reply = agent(unix, token="s3crét")
        assert reply == {"t": "error", "msg": "bad or missing token"}
        s.close()
    finally:
        d.stop()


def test_agent_connections_and_ranks_are_bounded(tmp_path, sock_dir):
    unix = os.path.join(sock_dir, "lim.sock")
    d = Daemon(
        DaemonConfig(port=None, unix=unix, http_port=None, max_ranks=2, max_connections=3, trace_dir=str(tmp_path))
    ).start_in_thread()
    try:
        a0, r0 = agent(unix, 0)
        a1, r1 = agent(unix, 1)
        a2, r2 = agent(unix, 2)
        assert (r0["t"], r1["t"]) == ("welcome", "welcome")
        assert r2 == {
            "t": "error",
            "msg": "rank 2 refused: the daemon tracks 2 connected ranks, its limit "
            "(raise it with --max-ranks or MS_MONITOR_MAX_RANKS=N)",
        }
        a0.close()  # rank 0 disconnects: a new rank takes its place
        wait_for(lambda: not d.store.ranks[0].connected, what="rank 0 gone")
        a3, r3 = agent(unix, 3)
        assert r3["t"] == "welcome" and sorted(d.store.ranks) == [1, 3] and d.store.evicted == 1
        a4, r4 = agent(unix, 1)  # a known rank, but a fourth connection
        a5, r5 = agent(unix, 1)
        assert r4["t"] == "welcome" and r5 == {
            "t": "error",
            "msg": "the daemon has 3 connections open, its limit (--max-connections)",
        }
        for s in (a1, a2, a3, a4, a5):
            s.close()
    finally:
        d.stop()


def test_a_stalled_frame_is_cut_off(daemon, monkeypatch):
    monkeypatch.setattr(wire, "FRAME_TIMEOUT", 0.5)
    s, _ = agent(daemon.config.unix, 0)
    s.sendall(struct.pack(">I", 1000) + b"\x81")  # announces 1000 bytes, sends one
    t0 = time.monotonic()
    assert s.recv(10) == b"" and time.monotonic() - t0 < 5  # closed, not held
    s.close()


def test_store_evicts_the_longest_disconnected_rank_and_refuses_when_all_are_connected():
    store = Store(max_ranks=2)
    assert store.connected(0, {}) and store.connected(1, {})
    assert not store.connected(2, {}) and store.refused == 1
    store.connected(1, {}, up=False)
    store.connected(0, {}, up=False)
    assert store.connected(2, {}) and sorted(store.ranks) == [0, 2]  # 1 went first, so it goes first
    store.add([{"r": 5, "s": 1, "ts": 1.0, "dt": 0.1}])  # room: rank 0 is disconnected
    assert sorted(store.ranks) == [2, 5] and store.evicted == 2


def test_a_rank_flood_keeps_the_daemon_small(tmp_path, sock_dir):
    """One relay inventing 40,960 rank numbers (10x the default limit). Measured with this flood: the
    daemon without the limit tracked them all, RSS 48.6 -> 179.8 MB; with it 48.4 -> 60.4 MB."""
    sock, ready = os.path.join(sock_dir, "flood.sock"), tmp_path / "ready.json"
    cmd = [sys.executable, "-m", "ms_monitor.cli", "daemon", "--port", "-1", "--unix", sock, "--http-port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--trace-dir", str(tmp_path / "t"), "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(ready.exists, what="the daemon")
        info = json.loads(ready.read_text())

        def rss(field):
            with open(f"/proc/{info['pid']}/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024

        before = rss("VmRSS:")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sock)
        s.sendall(wire.encode({"t": "hello", "v": 1, "role": "relay", "rank": -1}))
        assert read_frame(s)["t"] == "welcome"
        for b in range(10):
            batch = [{"r": b * 4096 + i, "s": 1, "ts": 1.0, "dt": 0.1} for i in range(4096)]
            s.sendall(wire.encode({"t": "b", "s": batch}))
        reply = read_frame(s)  # told once, the connection stays
        assert reply == {
            "t": "error",
            "msg": "4096 ranks (first 4096) dropped: rank 4096 refused: the daemon tracks 4096 connected ranks, "
            "its limit (raise it with --max-ranks or MS_MONITOR_MAX_RANKS=N)",
        }
        url = info["http"]
        from conftest import get_json

        status = wait_for(lambda: (st_ := get_json(url + "/api/status"))["refused"] == 36864 and st_, what="flood")
        metrics = raw_http(int(url.rsplit(":", 1)[1]), b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", raw=True)
        peak = rss("VmHWM:")
        s.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0 and not os.path.exists(info["token_file"])  # SIGTERM: a clean stop
    assert len(status["ranks"]) == 4096 and status["received"] == 4096 and status["max_ranks"] == 4096
    assert peak - before < 40 * 2**20, (before, peak)  # 4096 ranks of one sample each: +12 MB measured
    assert len(metrics) < 2 * 2**20  # one answer stays bounded with the ranks
    assert err.count("4096 ranks (first 4096) dropped") == 1  # one log line, not one per sample


# ------------------------------------------------------------------------------------ readers
@FAST
@given(st.binary(max_size=512))
def test_wire_decode_of_any_bytes_is_a_message_or_a_wire_error(data):
    try:
        msg = wire.decode(data)
    except WireError:
        return
    assert msg["t"] in wire.SCHEMAS


plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@FAST
@given(
    st.sampled_from(sorted(wire.SCHEMAS)),
    st.dictionaries(
        st.sampled_from(
            [
                "r",
                "s",
                "rank",
                "v",
                "role",
                "id",
                "data",
                "name",
                "seq",
                "last",
                "ts",
                "dt",
                "ph",
                "cfg",
                "status",
                "cur",
                "first",
                "sources",
                "steps",
                "start",
                "profiler",
                "ranks",
                "msg",
                "token",
            ]
        ),
        plain,
        max_size=8,
    ),
)
def test_wire_schema_refuses_every_wrong_value_with_a_wire_error(kind, fields):
    body = msgpack.packb({"t": kind, **fields}, use_bin_type=True)
    try:
        msg = wire.decode(body)
    except WireError:
        return
    assert wire.decode(wire.encode(msg)[4:]) == msg  # what passes is well-formed


def test_ranks_over_the_rank_limit_are_refused_on_the_wire(monkeypatch):
    big = {"t": "b", "s": [{"r": 1 << 20, "s": 1, "ts": 1.0, "dt": 0.1}]}
    with pytest.raises(
        WireError,
        match=r"b\.s\[0\]\.r = 1048576 is over the limit of 1048575 as a rank number "
        r"\(raise it with MS_MONITOR_MAX_RANK=N\)",
    ):
        wire.decode(msgpack.packb(big))
    monkeypatch.setenv("MS_MONITOR_MAX_RANK", str(1 << 21))
    assert wire.decode(msgpack.packb(big))["s"][0]["r"] == 1 << 20


@FAST
@given(st.text(max_size=40))
def test_host_check_and_tokens_never_raise(text):
    assert isinstance(HostCheck("127.0.0.1", 7780)(text), bool)
    assert isinstance(HostCheck("0.0.0.0", 7780)(text), bool)
    assert same_token(text, "s3cret") == (text == "s3cret")
    assert isinstance(bearer(text), str)


@FAST
@given(st.binary(max_size=300))
def test_trace_files_of_any_bytes_give_events_or_a_monitor_error(data):
    for read in (events_from_trace_view, lambda d: events_from_cpu_timestamps(d.decode("utf-8", "replace"))):
        try:
            events = read(data)
        except MonitorError:
            continue
        merge({0: [("x", events)]})


json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=15,
)


@FAST
@given(
    st.lists(
        st.dictionaries(st.sampled_from(["ph", "ts", "dur", "pid", "tid", "name", "args", "cat"]), json_value),
        max_size=5,
    )
)
def test_trace_events_of_any_shape_merge_or_give_a_monitor_error(events):
    try:
        merge({0: [("x", events_from_trace_view(json.dumps(events).encode()))]})
    except MonitorError:
        pass


@FAST
@given(st.dictionaries(st.sampled_from(["ranks", "steps", "start_step", "timeout", "profiler", "analyse"]), json_value))
def test_trace_requests_of_any_shape_give_a_job_or_a_monitor_error(daemon, req):
    try:
        daemon.request_trace(req)
    except MonitorError:
        pass
    assert daemon.traces.jobs == {}  # nothing is connected: no request can start a job


@pytest.mark.parametrize("data", [b"", b"\xff\xfe", b"   \n"])
def test_bad_token_files_are_monitor_errors(tmp_path, data):
    path = tmp_path / "token"
    path.write_bytes(data)
    with pytest.raises(MonitorError, match="token file"):
        read_token(str(path))


# ------------------------------------------------------------------------------------ console script
URL = "http://127.0.0.1:1"
CLI = [
    (["status", "--url", "notaurl"], "--url 'notaurl' is not an http://HOST:PORT address"),
    (
        ["status", "--url", "http://127.0.0.1:99999"],
        "--url 'http://127.0.0.1:99999' has a port that is not a number in 1..65535",
    ),
    (["status", "--url", URL], f"cannot reach the daemon at {URL}/api/status: [Errno 111] Connection refused"),
    (["daemon", "--port", "99999"], "port = 99999 is not a port in 0..65535 (0: any free port)"),
    (["daemon", "--http-port", "70000"], "http_port = 70000 is not a port in 0..65535 (0: any free port)"),
    (["daemon", "--port", "-5"], "port = -5 is not a port in 0..65535 (0: any free port)"),
    (["daemon", "--window", "0"], "window = 0 must be a positive integer"),
    (["daemon", "--max-ranks", "-1"], "max_ranks = -1 must be a positive integer"),
    (
        ["daemon", "--forward", "nowhere"],
        "address 'nowhere' must be 'unix:/path' or 'tcp:host:port' with a port in 1..65535",
    ),
    (
        ["daemon", "--host", "0.0.0.0"],
        "listening on ['0.0.0.0'] (beyond loopback) needs a token (--token or MS_MONITOR_TOKEN)",
    ),
    (["daemon", "--slow-ratio", "0.5"], "DetectorConfig.slow_ratio=0.5 must be above 1"),
    (["daemon", "--slow-window", "3"], "DetectorConfig.slow_window=3 must be 0 (off) or an integer >= 4"),
    (
        ["daemon", "--slow-window-fraction", "0.4"],
        "DetectorConfig.slow_window_fraction=0.4 must be in (0.5, 1]:"
        " more than half the window, or half a window of noise and bursts would raise",
    ),
    (["trace", "--steps", "0", "--url", URL], "--steps 0 is not a number of steps in 1..100000"),
    (
        ["trace", "--steps", "2", "--timeout", "-1", "--url", URL],
        "--timeout -1 is not a number of seconds in (0, 86400]",
    ),
    (["trace", "--steps", "2", "--ranks", "a", "--url", URL], "--ranks 'a': 'a' is not N or N-M"),
    (
        ["trace", "--steps", "2", "--ranks", "0-99999999", "--url", URL],
        "--ranks '0-99999999': rank = 99999999 is over the limit of 1048575 as a rank number "
        "(raise it with MS_MONITOR_MAX_RANK=N)",
    ),
    (["trace", "--steps", "2", "--url", "ftp://host/"], "--url 'ftp://host/' is not an http://HOST:PORT address"),
    (
        ["trace", "--steps", "2", "--token-file", "/nonexistent/token", "--url", URL],
        "token file '/nonexistent/token' does not exist",
    ),
]


@pytest.mark.parametrize("argv, message", CLI, ids=[" ".join(a) for a, _ in CLI])
def test_cli_bad_input_is_one_line_and_exit_2(argv, message):
    proc = subprocess.run([sys.executable, "-m", "ms_monitor.cli", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr == f"ms-monitor: error: {message}\n" and proc.stdout == ""


def test_cli_bad_limit_variable_is_one_line_and_exit_2():
    env = {**os.environ, "MS_MONITOR_MAX_RANKS": "lots"}
    proc = subprocess.run(
        [sys.executable, "-m", "ms_monitor.cli", "daemon"], capture_output=True, text=True, env=env, timeout=60
    )
    assert (proc.returncode, proc.stderr) == (2, "ms-monitor: error: MS_MONITOR_MAX_RANKS='lots' is not an integer\n")


def test_cli_debug_shows_the_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "ms_monitor.cli", "status", "--url", "notaurl", "--debug"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "MonitorError: --url 'notaurl'" in proc.stderr


# ------------------------------------------------------------------------------------ kill -9
WRITER = r"""
import json, sys, time
from ms_monitor.traces import TraceManager

root, job_ids = sys.argv[1], sys.argv[2:]
tm = TraceManager(root)  # also removes what a killed writer left
events = [{"ph": "X", "name": f"op{i}", "ts": 1.0e15 + i, "dur": 1.0, "pid": 1, "tid": 1} for i in range(3000)]
data = json.dumps(events).encode()
for job_id in job_ids:  # each whole; the parent may kill the last one while it is written
    job = tm.new_job(10, 2, None, 60.0, job_id=job_id)
    job.expected = {0, 1, 2, 3}
    for rank in sorted(job.expected):
        tm.on_tfile({"id": job_id, "rank": rank, "name": "agent_ranges.json", "seq": 0, "last": True, "data": data})
        if job_id == job_ids[-1] and rank == 3:
            print("finishing", flush=True)  # the last tdone merges and writes the trace
            t0 = time.monotonic()
        tm.on_tdone({"id": job_id, "rank": rank, "first": 10, "last": 11, "sources": ["agent_ranges.json"]})
    assert job.state == "done", job.errors
print(time.monotonic() - t0, flush=True)
"""


def test_kill_9_while_writing_a_trace_leaves_the_previous_one_whole(tmp_path):
    root = tmp_path / "traces"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)

    def run(job_ids, delay=None):
        """Write these traces; with `delay`, SIGKILL the writer that long after it starts merging the last."""
        cmd = [sys.executable, str(script), str(root), *job_ids]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "finishing\n", proc.stderr.read()
        if delay is None:
            took = float(proc.stdout.readline())
            assert proc.wait(60) == 0, proc.stderr.read()
            return took
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
        proc.stdout.close()
        proc.stderr.close()

    t0 = time.monotonic()
    finish = run(["job00"])  # seconds from the last tdone to a written trace (merge, write, manifest)
    rng = random.Random(16)
    whole = 0
    for i in range(1, 21):
        previous, current = f"job{i - 1:02d}", f"job{i:02d}"
        # the next run after a kill first writes the killed trace again (whole), then the next one, killed
        run([previous, current] if i > 1 else [current], rng.uniform(0.0, 1.2 * finish))
        verify_manifest(root / previous)  # the previous trace is whole and matches its manifest
        assert sorted(os.listdir(root / previous)) == ["manifest.json", "merged_trace.json"]  # no temp left
        if (root / current / "manifest.json").exists():
            verify_manifest(root / current)  # killed after the manifest: a whole trace too
            whole += 1
        else:
            with pytest.raises(FileError):
                verify_manifest(root / current)
    run(["job20"])
    verify_manifest(root / "job20")
    assert sorted(os.listdir(root / "job20")) == ["manifest.json", "merged_trace.json"]
    assert whole < 20  # some kills landed before the trace was whole
    assert time.monotonic() - t0 < 90
