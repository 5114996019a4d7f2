"""The wire protocol: frames round-trip, and anything off-schema is refused before it is used."""

import datetime
import struct

import msgpack
import pytest

from ms_monitor import WireError, wire


def sample(**over):
    s = {"r": 3, "s": 10, "ts": 1.7e9, "dt": 0.05, "ct": 0.01, "ph": {"forward": 0.02}, "tok": 4096, "hm": 1 << 30}
    s.update(over)
    return s


def roundtrip(msg):
    frame = wire.encode(msg)
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    return wire.decode(frame[4:])


def test_batch_roundtrip_keeps_values():
    out = roundtrip({"t": "b", "s": [sample(), sample(r=0, s=11, ct=None)]})
    assert out["s"][0] == sample()
    assert "ct" not in out["s"][1] and out["s"][1]["r"] == 0


def test_unknown_keys_are_dropped():
    out = roundtrip({"t": "b", "s": [sample(extra="x")], "junk": 1})
    assert "extra" not in out["s"][0] and "junk" not in out


@pytest.mark.parametrize(
    "bad",
    [
        sample(r=True),  # a bool is not a rank
        sample(dt=float("nan")),
        sample(dt=-1.0),
        sample(s="10"),
        sample(ph={"x" * 200: 0.1}),  # name too long
        sample(ph={f"p{i}": 0.1 for i in range(100)}),  # too many phases
        {"s": 1, "ts": 1.0, "dt": 0.1},  # no rank
    ],
)
def test_bad_samples_are_refused(bad):
    body = msgpack.packb({"t": "b", "s": [bad]}, use_bin_type=True)
    with pytest.raises(WireError):
        wire.decode(body)


def test_not_msgpack_and_extension_types_are_refused():
    with pytest.raises(WireError, match="not a msgpack"):
        wire.decode(b"\xc1garbage")
    stamp = msgpack.packb({"t": "welcome", "v": datetime.datetime.now(datetime.timezone.utc)}, datetime=True)
    with pytest.raises(WireError):
        wire.decode(stamp)
    with pytest.raises(WireError, match="unknown message type"):
        wire.decode(msgpack.packb({"t": "exec", "code": "import os"}))


def test_oversized_frames_are_refused_from_the_header():
    with pytest.raises(WireError, match="limit"):
        wire.frame_length(struct.pack(">I", wire.MAX_FRAME + 1))
    with pytest.raises(WireError):
        wire.encode(
            {"t": "tfile", "id": "a", "rank": 0, "name": "x", "seq": 0, "last": True, "data": b"x" * (wire.CHUNK + 1)}
        )


def test_frame_reader_reassembles_split_frames():
    frames = [wire.encode({"t": "welcome", "v": 1}), wire.encode({"t": "b", "s": [sample()]})]
    blob = b"".join(frames)
    reader = wire.FrameReader()
    got = []
    for i in range(0, len(blob), 7):
        got += reader.feed(blob[i : i + 7])
    assert [wire.decode(b)["t"] for b in got] == ["welcome", "b"]


def test_parse_address():
    assert wire.parse_address("unix:/tmp/x.sock") == ("unix", "/tmp/x.sock")
    assert wire.parse_address("tcp:127.0.0.1:7781") == ("tcp", ("127.0.0.1", 7781))
    assert wire.parse_address("localhost:80") == ("tcp", ("localhost", 80))
    for bad in ("", "unix:", "tcp:host", "tcp:host:0", "host:99999"):
        with pytest.raises(WireError):
            wire.parse_address(bad)
