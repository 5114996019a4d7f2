"""Hostile and careless input: msgpack blobs and the `ms-layout` console script.

Whatever bytes or structures reach ``ms_layout.loads`` give a Layout, a ParallelConfig or a
LayoutError, never another exception; sizes over the limits are refused before any rank table is
built; every bad flag of the console script is one line on stderr and exit code 2.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ms_layout import Layout, LayoutError, ParallelConfig, dumps, loads
from ms_layout.testing import run_script

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Values msgpack can carry: what a hostile blob may hold in any field.
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from(["dp", "tp", "mp", "None", "tp-cp-ep-dp-pp", "", "-1"])
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
SIZES = st.integers(min_value=-2, max_value=2**64 - 1) | st.sampled_from([10**9, 2**63, 2**16, 2**16 + 1]) | VALUES


def _envelope(kind, data, version=1, fmt="ms-layout") -> bytes:
    return msgpack.packb({"format": fmt, "version": version, "kind": kind, "data": data}, use_bin_type=True)


def _only_layout_error(blob: bytes):
    try:
        obj = loads(blob)
    except LayoutError:
        return None
    assert type(obj) in (Layout, ParallelConfig)
    assert loads(dumps(obj)) == obj  # what is accepted round-trips
    return obj


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_give_only_layout_error(blob):
    _only_layout_error(blob)


@FUZZ
@given(st.dictionaries(st.sampled_from(["format", "version", "kind", "data"]), VALUES, max_size=4))
def test_random_envelopes_give_only_layout_error(envelope):
    _only_layout_error(msgpack.packb(envelope, use_bin_type=True))


@FUZZ
@given(
    st.fixed_dictionaries(
        {},
        optional={k: SIZES for k in ("dp", "tp", "cp", "pp", "ep", "vpp")}
        | {"optimizer_shard": VALUES, "order": VALUES, "zz": VALUES},
    )
)
def test_random_parallel_configs_give_only_layout_error(data):
    _only_layout_error(_envelope("ParallelConfig", data))


@FUZZ
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "device_matrix": st.lists(SIZES, max_size=5) | VALUES,
            "alias_names": st.lists(st.sampled_from(["dp", "mp", "sp", "None", ""]) | VALUES, max_size=5) | VALUES,
            "dims": st.lists(st.lists(st.sampled_from(["dp", "mp", "sp"]) | VALUES, max_size=3), max_size=4) | VALUES,
            "rank_list": st.lists(SIZES, max_size=8) | VALUES,
        },
    )
)
def test_random_layouts_give_only_layout_error(data):
    _only_layout_error(_envelope("Layout", data))


@FUZZ
@given(st.data())
def test_damaged_good_blobs_give_only_layout_error(data):
    good = dumps(Layout((2, 4), ("dp", "mp"), rank_list=tuple(range(8, 16)))("mp", "dp"))
    cut = data.draw(st.integers(0, len(good)))
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(0, 255)), max_size=4))
    blob = bytearray(good[:cut] if data.draw(st.booleans()) else good)
    for pos, byte in flips:
        if pos < len(blob):
            blob[pos] = byte
    _only_layout_error(bytes(blob))


BLOB_CASES = [
    (_envelope("ParallelConfig", {"dp": 10**9}), "world size dp*tp*cp*pp = 1000000000 is over the limit of 65536"),
    (_envelope("ParallelConfig", {"dp": 2**63}), "world size dp*tp*cp*pp = 9223372036854775808 is over the limit"),
    (_envelope("ParallelConfig", {"tp": 2**9, "pp": 2**8}), "world size dp*tp*cp*pp = 131072 is over"),
    (_envelope("ParallelConfig", {"vpp": 10**6}), "vpp = 1000000 is over the limit of 1024"),
    (_envelope("ParallelConfig", {"dp": True}), "dp=True; parallel sizes must be positive ints"),
    (_envelope("ParallelConfig", {"optimizer_shard": 1}), "optimizer_shard=1; expected True or False"),
    (_envelope("ParallelConfig", {}, version=True), "version True"),
    (_envelope("ParallelConfig", {}, version=1.0), "version 1.0"),
    (_envelope(["ParallelConfig"], {}), "unknown kind ['ParallelConfig']"),
    (_envelope("Layout", {"device_matrix": [2**32, 2**32], "alias_names": ["a", "b"], "dims": None}), "product"),
    (_envelope("Layout", {"device_matrix": [1] * 65, "alias_names": [], "dims": None}), "axes = 65 is over"),
    (_envelope("Layout", {"device_matrix": [True], "alias_names": ["a"], "dims": None}), "has size True"),
    (_envelope("Layout", {"device_matrix": [2], "alias_names": ["a"], "dims": None, "rank_list": [0, True]}), "ints"),
    (_envelope("Layout", {"device_matrix": [2], "alias_names": ["a"], "dims": ["a"]}), "entry 'a' is not a list"),
    (_envelope("Layout", {"device_matrix": 2, "alias_names": ["a"], "dims": None}), "device_matrix is 2"),
    (_envelope("Layout", [1, 2]), "not a layout dict"),
]


@pytest.mark.parametrize(("blob", "message"), BLOB_CASES, ids=[m[:40] for _, m in BLOB_CASES])
def test_bad_blobs_name_the_value(blob, message):
    with pytest.raises(LayoutError) as info:
        loads(blob)
    assert message in str(info.value)


def test_blob_over_the_size_limit(monkeypatch):
    monkeypatch.setenv("MS_LAYOUT_MAX_BLOB_BYTES", "100")
    with pytest.raises(LayoutError, match="blob size = 101 is over the limit of 100 bytes"):
        loads(b"\x00" * 101)


def test_limits_are_raisable(monkeypatch):
    with pytest.raises(LayoutError, match="MS_LAYOUT_MAX_WORLD_SIZE"):
        ParallelConfig(dp=2**17)
    monkeypatch.setenv("MS_LAYOUT_MAX_WORLD_SIZE", str(2**17))
    assert ParallelConfig(dp=2**17, tp=1).world_size == 2**17
    assert Layout((2**17,), ("dp",)).rank_count == 2**17


def test_global_shape_of_the_wrong_type():
    layout = Layout((2,), ("dp",))("dp")
    for shape in [(4.0,), ("4",), (True,), (None,)]:
        with pytest.raises(LayoutError, match="must hold ints"):
            layout.shard_shape(shape)
    with pytest.raises(LayoutError, match="global shape dims = 65 is over the limit of 64"):
        layout.shard_shape((1,) * 65)


# ---------------------------------------------------------------------------------- console script
CLI_CASES = [
    (["--dp", "1000000000"], "world size dp*tp*cp*pp = 1000000000 is over the limit of 65536 ranks"),
    (["--dp", str(2**63)], "world size dp*tp*cp*pp = 9223372036854775808 is over the limit"),
    (["config", "--tp", "1024", "--pp", "1024", "--json"], "world size dp*tp*cp*pp = 1048576 is over"),
    (["--dp", "0"], "dp=0; parallel sizes must be positive ints"),
    (["--pp", "-3"], "pp=-3; parallel sizes must be positive ints"),
    (["--vpp", "100000"], "vpp = 100000 is over the limit of 1024"),
    (["--dp", "3", "--ep", "2"], "ep=2 must divide dp*cp=3"),
    (["--order", "tp-dp"], "order 'tp-dp' must name each of tp-cp-ep-dp-pp"),
    (["--order", "ep-tp-cp-dp-pp", "--dp", "2", "--ep", "2", "--tp", "2"], "order 'ep-tp-cp-dp-pp' gives rank 1 tp=1"),
    (["layout", "--mesh", "dp=2", "--map", "xx", "--shape", "4"], "unknown alias 'xx'"),
    (["layout", "--mesh", "dp=a", "--map", "dp", "--shape", "4"], "expected comma-separated ints, got 'a'"),
    (["layout", "--mesh", "dp", "--map", "dp", "--shape", "4"], "mesh entry 'dp' must look like name=size"),
    (["layout", "--mesh", "dp=2", "--map", "dp", "--shape", "1.5"], "expected comma-separated ints, got '1.5'"),
    (["layout", "--mesh", "dp=2", "--map", "dp", "--shape", "3"], "dim 0 of global shape (3,) has size 3"),
    (["layout", "--mesh", "dp=2", "--map", "dp", "--shape=-4"], "global shape (-4,) has a negative size"),
    (["layout", "--mesh", "dp=2", "--map", "dp,dp", "--shape", "4,4"], "alias 'dp' is used on two tensor dims"),
    (["layout", "--mesh", "dp=0", "--map", "dp", "--shape", "4"], "device_matrix (0,) has size 0"),
    (["layout", "--mesh", "dp=2,dp=2", "--map", "dp", "--shape", "4"], "alias_names ('dp', 'dp') repeats a name"),
    (["layout", "--mesh", f"dp={10**12}", "--map", "dp", "--shape", "4"], "product = 1000000000000 is over the limit"),
    (["layout", "--mesh", "dp=2", "--map", "dp", "--shape", ",".join(["1"] * 65)], "global shape dims = 65 is over"),
]


@pytest.mark.parametrize(("argv", "message"), CLI_CASES, ids=[" ".join(a)[:60] for a, _ in CLI_CASES])
def test_cli_bad_input_is_one_line_exit_2(argv, message):
    run_script("ms_layout.cli", argv).assert_one_line_error("ms-layout", message)


def test_cli_huge_world_is_refused_before_allocating():
    # dp = 10**9 built a billion-entry rank table (GBs, minutes); now the limit stops it first.
    run = run_script("ms_layout.cli", ["--dp", "1000000000", "--json"], timeout=30)
    assert run.rc == 2
    assert run.max_rss_mb < 100, f"peak RSS {run.max_rss_mb:.0f} MB"
    assert run.seconds < 10, f"took {run.seconds:.1f} s"


def test_cli_debug_shows_the_traceback():
    run = run_script("ms_layout.cli", ["config", "--dp", "0", "--debug"])
    assert run.rc == 1
    assert "Traceback" in run.stderr
    assert (
        run.stderr.rstrip().splitlines()[-1]
        == "ms_layout.errors.LayoutError: dp=0; parallel sizes must be positive ints"
    )


def test_cli_bad_flag_is_one_line_exit_2():
    run = run_script("ms_layout.cli", ["--dp", "two"])
    run.assert_one_line_error("ms-layout config", "argument --dp: invalid int value: 'two' (ms-layout config -h")
