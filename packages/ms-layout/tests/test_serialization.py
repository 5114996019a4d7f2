"""msgpack round trips with a format version; foreign bytes are refused with a clear error."""

import msgpack
import pytest

from ms_layout import Layout, LayoutError, ParallelConfig, dumps, loads


def test_round_trips():
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"), rank_list=tuple(range(8, 16)))("mp", ("sp", "dp"))
    cfg = ParallelConfig(dp=2, tp=2, pp=2, optimizer_shard=True, vpp=2)
    assert loads(dumps(layout)) == layout
    assert loads(dumps(cfg), expect="ParallelConfig") == cfg
    assert msgpack.unpackb(dumps(cfg))["version"] == 1


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"\xc1\xc1\xc1", "msgpack could not read 3 bytes"),
        (b"", "msgpack could not read 0 bytes"),
        (msgpack.packb({"format": "safetensors"}), "format is 'safetensors'"),
        (msgpack.packb([1, 2]), "format is 'list'"),
        (msgpack.packb({"format": "ms-layout", "version": 99, "kind": "Layout"}), "version 99"),
        (msgpack.packb({"format": "ms-layout", "version": 1, "kind": "Pickle"}), "unknown kind 'Pickle'"),
        (msgpack.packb({"format": "ms-layout", "version": 1, "kind": "Layout", "data": {"x": 1}}), "not a layout dict"),
        (msgpack.packb({"format": "ms-layout", "version": 1, "kind": "ParallelConfig", "data": {"dp": 0}}), "dp=0"),
        (msgpack.packb({"format": "ms-layout", "version": 1, "kind": "ParallelConfig", "data": {"zz": 1}}), "zz"),
    ],
)
def test_bad_bytes_give_clear_errors(blob, message):
    with pytest.raises(LayoutError, match=message):
        loads(blob)


def test_expect_and_unknown_types():
    with pytest.raises(LayoutError, match="holds a ParallelConfig, expected a Layout"):
        loads(dumps(ParallelConfig()), expect="Layout")
    with pytest.raises(LayoutError, match="cannot serialize dict"):
        dumps({"a": 1})
    with pytest.raises(LayoutError, match="expected bytes, got str"):
        loads("abc")
