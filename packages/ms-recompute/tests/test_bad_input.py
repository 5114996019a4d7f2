"""Hostile and careless input: recompute plan files and the `ms-recompute` console script.

Whatever bytes or structures reach the plan reader give a RecomputePlan or a RecomputeError, never
another exception; layer counts over MS_RECOMPUTE_MAX_LAYERS are refused before anything is built;
every bad argument of the console script is one line on stderr and exit code 2.
"""

from __future__ import annotations

import json

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ms_layout.testing import run_script
from ms_recompute import RecomputeError, RecomputePlan
from ms_recompute.plan import Granularity

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GOOD = RecomputePlan.parse("0-1=full,3=mlp+self_attn.o_proj", 4, overlap=True)

LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=6)
    | st.sampled_from(["0-3=full", "1=mlp", "0-999999999=full", "9" * 5000 + "=full", "none", 10**9])
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
PREDICTION = st.fixed_dictionaries(
    {},
    optional={
        k: st.integers(-1, 2**40) | VALUES
        for k in ("baseline_bytes", "kept_bytes", "working_bytes", "recompute_s", "budget_bytes", "method", "zz")
    },
)


def _envelope(data) -> bytes:
    return msgpack.packb({"format": "ms-layout", "version": 1, "kind": "RecomputePlan", "data": data})


def _only_recompute_error(blob: bytes):
    try:
        plan = RecomputePlan.loads(blob)
    except RecomputeError:
        return None
    assert isinstance(plan, RecomputePlan)
    assert RecomputePlan.loads(plan.dumps()) == plan
    plan.format()  # everything accepted can be printed
    return plan


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_give_only_recompute_error(blob):
    _only_recompute_error(blob)


@FUZZ
@given(st.data())
def test_damaged_plans_give_only_recompute_error(data):
    blob = bytearray(GOOD.dumps())
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    _only_recompute_error(bytes(blob[: data.draw(st.integers(0, len(blob)))]))


@FUZZ
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "schema": st.sampled_from([1, True, 1.0, 2]) | VALUES,
            "spec": st.sampled_from(["0-1=full", "0=mlp", "", "0=full,0=none", "x"]) | VALUES,
            "num_layers": st.integers(-1, 10**12) | VALUES,
            "overlap": st.booleans() | VALUES,
            "comms": st.integers(-1, 10**12) | VALUES,
            "prediction": st.none() | PREDICTION | VALUES,
        },
    )
)
def test_random_plan_dicts_give_only_recompute_error(data):
    _only_recompute_error(_envelope(data))


PLAN = {"schema": 1, "spec": "0=full", "num_layers": 2, "overlap": False, "comms": 1, "prediction": None}
PRED = {"baseline_bytes": 10, "kept_bytes": 5, "working_bytes": 1, "recompute_s": 0.5}
BAD_PLANS = [
    ({**PLAN, "num_layers": 10**9}, "num_layers = 1000000000 is over the limit of 256 layers"),
    ({**PLAN, "comms": 10**9}, "comms = 1000000000 is over the limit of 64"),
    ({**PLAN, "overlap": "false"}, "overlap='false'; expected True or False"),
    ({**PLAN, "spec": 7}, "plan spec 7; expected text like '0-3=full'"),
    ({**PLAN, "spec": "9" * 5000 + "=full"}, "layers must be 'i' or 'i-j'"),
    ({**PLAN, "schema": True}, "plan schema True"),
    ({**PLAN, "prediction": {**PRED, "kept_bytes": "5"}}, "prediction kept_bytes='5'; expected an int >= 0"),
    ({**PLAN, "prediction": {**PRED, "recompute_s": float("nan")}}, "prediction recompute_s=nan"),
    ({**PLAN, "prediction": {**PRED, "zz": 1}}, "plan prediction has unknown fields ['zz']"),
    ({**PLAN, "prediction": [1]}, "plan prediction [1]; expected an object or null"),
    ({k: v for k, v in PLAN.items() if k != "comms"}, "malformed plan dict: missing ['comms']"),
]


@pytest.mark.parametrize(("data", "message"), BAD_PLANS, ids=[m[:40] for _, m in BAD_PLANS])
def test_bad_plans_name_the_value(data, message):
    with pytest.raises(RecomputeError) as info:
        RecomputePlan.loads(_envelope(data))
    assert message in str(info.value)


def test_plan_files(tmp_path, monkeypatch):
    with pytest.raises(RecomputeError, match="plan file '.*missing.msgpack' does not exist"):
        RecomputePlan.load(tmp_path / "missing.msgpack")
    with pytest.raises(RecomputeError, match="is a folder, not a file"):
        RecomputePlan.load(tmp_path)
    (tmp_path / "junk.msgpack").write_bytes(b"\xc1")
    with pytest.raises(RecomputeError, match="plan file '.*junk.msgpack': not a recompute plan"):
        RecomputePlan.load(tmp_path / "junk.msgpack")
    monkeypatch.setenv("MS_RECOMPUTE_MAX_PLAN_BYTES", "10")
    (tmp_path / "big.msgpack").write_bytes(b"\x00" * 11)
    with pytest.raises(RecomputeError, match="is over the limit of 10 bytes"):
        RecomputePlan.load(tmp_path / "big.msgpack")
    monkeypatch.delenv("MS_RECOMPUTE_MAX_PLAN_BYTES")
    GOOD.save(tmp_path / "good.msgpack")
    assert RecomputePlan.load(tmp_path / "good.msgpack") == GOOD
    assert not list(tmp_path.glob(".*tmp-*"))
    assert RecomputePlan.load(tmp_path / "good.msgpack").layers[3].granularity is Granularity.SELECTIVE


# ---------------------------------------------------------------------------------- console script
CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("configs")
    (tmp / "ok.json").write_text(json.dumps(CONFIG))
    (tmp / "layers.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 10**9}))
    (tmp / "headdim.json").write_text(json.dumps({**CONFIG, "head_dim": "64"}))
    (tmp / "hidden.json").write_text(json.dumps({**CONFIG, "hidden_size": 256.0}))
    (tmp / "arch.json").write_text(json.dumps({**CONFIG, "model_type": "gpt2"}))
    (tmp / "list.json").write_text("[1, 2]")
    (tmp / "bad.json").write_bytes(b"\xff\xfe")
    (tmp / "trunc.json").write_text('{"model_type": "qw')
    (tmp / "empty").mkdir()
    return tmp


R = ["report", "--budget", "1GiB", "--config"]
CLI_CASES = [
    ([*R, "{tmp}/missing.json"], "no config file at '{tmp}/missing.json'"),
    ([*R, "{tmp}/empty"], "no config file at '{tmp}/empty/config.json'"),
    ([*R, "{tmp}/bad.json"], "config file '{tmp}/bad.json' is not UTF-8 text (byte 0)"),
    ([*R, "{tmp}/trunc.json"], "config file '{tmp}/trunc.json' is not valid JSON"),
    ([*R, "{tmp}/list.json"], "'{tmp}/list.json' holds a list, not a config object"),
    ([*R, "{tmp}/arch.json"], "model_type 'gpt2' is not supported"),
    ([*R, "{tmp}/layers.json"], "num_hidden_layers = 1000000000 is over the limit of 256 layers"),
    ([*R, "{tmp}/headdim.json"], "head_dim='64'; expected a positive int"),
    ([*R, "{tmp}/hidden.json"], "hidden_size=256.0; expected a positive int"),
    ([*R, "{tmp}/ok.json", "--arch", "llama"], "--arch llama but '{tmp}/ok.json' says model_type 'qwen2'"),
    ([*R, "{tmp}/ok.json", "--tflops", "0"], "--tflops 0.0: expected a positive number"),
    ([*R, "{tmp}/ok.json", "--tflops", "nan"], "--tflops nan: expected a positive number"),
    ([*R, "{tmp}/ok.json", "--comm-ms=-1"], "--comm-ms -1.0: expected a number >= 0"),
    ([*R, "{tmp}/ok.json", "--batch", "0"], "batch=0; expected a positive int"),
    ([*R, "{tmp}/ok.json", "--seq=-5"], "seq=-5; expected a positive int"),
    ([*R, "{tmp}/ok.json", "--tp", "3"], "tp=3 does not divide num_attention_heads=8"),
    ([*R, "{tmp}/ok.json", "--out", "/proc/p.msgpack"], "cannot write --out '/proc/p.msgpack'"),
    ([*R, "{tmp}/ok.json", "--out", "{tmp}/no/p.msgpack"], "--out '{tmp}/no/p.msgpack': folder '{tmp}/no' does not"),
    ([*R, "{tmp}/ok.json", "--out", "{tmp}"], "--out '{tmp}' is a folder; give a file name"),
    (["report", "--budget", "lots", "--config", "{tmp}/ok.json"], "budget 'lots': expected a size like 20GiB"),
    (["report", "--budget", "1KiB", "--config", "{tmp}/ok.json"], "budget 1024 bytes is below the lowest peak"),
]


@pytest.mark.parametrize(("argv", "message"), CLI_CASES, ids=[" ".join(a[3:])[:60] for a, _ in CLI_CASES])
def test_cli_bad_input_is_one_line_exit_2(files, argv, message):
    run = run_script("ms_recompute.cli", [a.format(tmp=files) for a in argv])
    run.assert_one_line_error("ms-recompute", message.format(tmp=files))


def test_cli_huge_layer_count_is_refused_before_allocating(files):
    run = run_script("ms_recompute.cli", [*R, str(files / "layers.json")], timeout=30)
    assert run.rc == 2
    assert run.max_rss_mb < 100, f"peak RSS {run.max_rss_mb:.0f} MB"
    assert run.seconds < 10, f"took {run.seconds:.1f} s"


def test_cli_largest_allowed_model_plans_in_seconds(files):
    # 256 layers under a tight budget: the exact frontier gives up after MS_RECOMPUTE_MAX_EXACT_WORK
    # states and the greedy planner (linear per step) finishes; it took minutes before.
    path = files / "l256.json"
    path.write_text(json.dumps({**CONFIG, "num_hidden_layers": 256}))
    run = run_script("ms_recompute.cli", ["report", "--budget", "10GiB", "--config", str(path), "--json"], timeout=120)
    assert run.rc == 0, run.stderr
    assert json.loads(run.stdout)["plan"]["method"] == "greedy"
    assert run.seconds < 30, f"took {run.seconds:.1f} s"
