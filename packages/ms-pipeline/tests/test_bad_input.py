"""Hostile and careless input: schedule files (msgpack, CSV, text) and the `ms-pipeline` console script.

Whatever bytes or structures reach the schedule readers give a Schedule or a ScheduleError, never
another exception; schedule sizes over MS_PIPELINE_MAX_SCHEDULE_SIZE are refused before anything is
built; every bad argument of the console script is one line on stderr and exit code 2.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ms_layout.testing import run_script
from ms_pipeline import ScheduleError
from ms_pipeline.ir import Schedule
from ms_pipeline.schedules import build
from ms_pipeline.serialize import dumps, from_csv, load, loads, save, to_csv
from ms_pipeline.simulate import CostModel

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GOOD = build("zbv", 2, 3)

LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=6)
    | st.sampled_from(["0F0", "1B0", "(0F1;1B0)OVERLAP_F_B", "zbv", "0" * 5000 + "F0", 10**9])
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
ACTION_TEXT = st.sampled_from(["0F0", "0B0", "0W0", "1F0", "1B0", "1W0", "2BW1", "0SEND_F0", "(0F1;1B0)OVERLAP_F_B"])
CELLS = ACTION_TEXT | st.text(alphabet='0123456789FBWIOSENDRCV_();," \n\x00', max_size=12)


def _only_schedule_error(read, *args, **kwargs):
    try:
        schedule = read(*args, **kwargs)
    except ScheduleError:
        return None
    assert isinstance(schedule, Schedule)
    assert Schedule.from_dict(schedule.to_dict()) == schedule
    return schedule


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_give_only_schedule_error(blob):
    _only_schedule_error(loads, blob)


@FUZZ
@given(st.data())
def test_damaged_msgpack_gives_only_schedule_error(data):
    blob = bytearray(dumps(GOOD))
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    _only_schedule_error(loads, bytes(blob[: data.draw(st.integers(0, len(blob)))]))


@FUZZ
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "schema": st.sampled_from([1, True, 1.0, 2]) | VALUES,
            "name": st.sampled_from(["zbv", "x y", ""]) | VALUES,
            "num_stages": st.integers(-2, 10**12) | VALUES,
            "num_microbatches": st.integers(-2, 10**12) | VALUES,
            "stage_to_rank": st.lists(st.integers(-1, 4) | VALUES, max_size=6) | VALUES,
            "actions": st.lists(st.lists(ACTION_TEXT | VALUES, max_size=6), max_size=4) | VALUES,
        },
    )
)
def test_random_schedule_dicts_give_only_schedule_error(data):
    blob = msgpack.packb({"format": "ms-layout", "version": 1, "kind": "Schedule", "data": data}, use_bin_type=True)
    _only_schedule_error(loads, blob)


@FUZZ
@given(st.lists(st.lists(CELLS, max_size=8), max_size=5), st.sampled_from(["ms", "torch"]))
def test_random_csv_gives_only_schedule_error(rows, dialect):
    text = "\n".join(",".join(row) for row in rows)
    _only_schedule_error(from_csv, text, dialect=dialect)


@FUZZ
@given(st.text(max_size=300), st.data())
def test_random_text_gives_only_schedule_error(noise, data):
    good = GOOD.to_text()
    cut = data.draw(st.integers(0, len(good)))
    _only_schedule_error(Schedule.from_text, good[:cut] + noise + good[cut:])


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("a.csv", b"\xff\xfe", "schedule file '{p}': not UTF-8 text (byte 0)"),
        ("a.txt", b"\xc3", "schedule file '{p}': not UTF-8 text (byte 0)"),
        ("a.csv", b"0F0,0Q1\n", "cannot read action '0Q1'"),
        ("a.csv", b"0F0\x00\n", "cannot read action '0F0\\x00'"),
        ("a.csv", b"", "the CSV holds no rows"),
        ("a.txt", b"schedule x: stages=2", "first line must be 'schedule NAME: stages=S"),
        ("a.txt", b"schedule x: stages=100000 microbatches=100000 placement=0\n", "= 10000000000 is over the limit"),
        (
            "a.txt",
            b"schedule x: stages=1 microbatches=1 placement=0\nrank 0: " + b"9" * 5000 + b"F0\n",
            "characters long",
        ),
        ("a.msgpack", b"\x93\x01\x02", "not an ms-layout blob"),
        ("a.msgpack", b"", "msgpack could not read 0 bytes"),
        ("a.json", b"{}", "cannot tell the format of '{p}'"),
    ],
)
def test_bad_files_name_the_file_and_the_value(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ScheduleError) as info:
        load(path)
    assert message.format(p=path) in str(info.value)


def test_csv_with_too_many_actions_is_refused_before_parsing(tmp_path, monkeypatch):
    monkeypatch.setenv("MS_PIPELINE_MAX_SCHEDULE_SIZE", "16")
    path = tmp_path / "big.csv"
    path.write_text(",".join(["0F0"] * 129) + "\n")
    with pytest.raises(ScheduleError, match="holds 129 actions, over the limit of 128"):
        load(path)


def test_file_over_the_size_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("MS_PIPELINE_MAX_FILE_BYTES", "100")
    path = tmp_path / "big.txt"
    path.write_text("x" * 101)
    with pytest.raises(ScheduleError, match="is over the limit of 100 bytes"):
        load(path)


def test_missing_and_folder_files(tmp_path):
    with pytest.raises(ScheduleError, match="does not exist"):
        load(tmp_path / "missing.csv")
    (tmp_path / "d.csv").mkdir()
    with pytest.raises(ScheduleError, match="is a folder, not a file"):
        load(tmp_path / "d.csv")


def test_builders_refuse_sizes_over_the_limit(monkeypatch):
    with pytest.raises(ScheduleError, match="1000 stages x 1000 microbatches = 1000000 is over the limit of 16384"):
        build("1f1b", 1000, 1000)
    with pytest.raises(ScheduleError, match="interleaved \\(64 ranks x 4\\) size 256 stages x 128 microbatches"):
        build("interleaved", 64, 128, stages_per_rank=4)
    with pytest.raises(ScheduleError, match="the V pattern padded to 199 microbatches"):
        build("zbv", 100, 1)
    with pytest.raises(ScheduleError, match="zbv-adaptive search 32 ranks x 64 stages x 8 microbatches = 16384"):
        build("zbv-adaptive", 32, 8)
    monkeypatch.setenv("MS_PIPELINE_MAX_SCHEDULE_SIZE", str(1 << 20))
    assert build("1f1b", 2, 10_000).num_microbatches == 10_000


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), "1", True, None])
def test_cost_model_refuses_non_finite_and_non_numbers(value):
    with pytest.raises(ScheduleError, match="must be a finite number"):
        CostModel(f=value)


def test_round_trip_still_works(tmp_path):
    for suffix in (".msgpack", ".csv", ".txt"):
        path = save(GOOD, tmp_path / f"s{suffix}")
        assert load(path) == GOOD if suffix != ".csv" else to_csv(load(path)) == to_csv(GOOD)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.csv", "s.msgpack", "s.txt"]  # no temp files left


# ---------------------------------------------------------------------------------- console script
SIM = ["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2"]
DRAW = ["draw", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2"]
CLI_CASES = [
    (["validate", "{tmp}/missing.csv"], "schedule file '{tmp}/missing.csv' does not exist"),
    (["validate", "{tmp}/bad.csv"], "schedule file '{tmp}/bad.csv': not UTF-8 text (byte 0)"),
    (["validate", "{tmp}/bad.csv", "--torch"], "schedule file '{tmp}/bad.csv': not UTF-8 text (byte 0)"),
    (["validate", "{tmp}/missing.csv", "--torch"], "schedule file '{tmp}/missing.csv' does not exist"),
    (["validate", "{tmp}/ok.txt", "--torch"], "--torch reads PyTorch's CSV; '{tmp}/ok.txt' is not a .csv file"),
    (["validate", "{tmp}"], "cannot tell the format of '{tmp}'"),
    (["validate", "{tmp}/dir.csv"], "schedule file '{tmp}/dir.csv' is a folder, not a file"),
    (["validate", "{tmp}/q.csv"], "schedule file '{tmp}/q.csv': cannot read action '0Q1'"),
    (["validate", "{tmp}/huge.txt"], "schedule size 99999999999 stages x 99999999999 microbatches"),
    (
        ["validate", "{tmp}/fields.msgpack"],
        "schedule file '{tmp}/fields.msgpack': ms-layout blob of kind Schedule has bad data: num_stages must be an int",
    ),
    (["validate", "{tmp}/rows.msgpack"], "schedule actions must be a list of lists of action strings, got ['0F0']"),
    (
        ["simulate", "--schedule", "1f1b", "--stages", "1000", "--microbatches", "1000"],
        "1f1b size 1000 stages x 1000 microbatches = 1000000 is over the limit of 16384 stage x microbatch pairs"
        " (raise it with MS_PIPELINE_MAX_SCHEDULE_SIZE=N)",
    ),
    (
        ["simulate", "--schedule", "zbv-adaptive", "--stages", "64", "--microbatches", "64"],
        "MS_PIPELINE_MAX_ADAPTIVE_WORK",
    ),
    (
        ["simulate", "--schedule", "1f1b", "--stages=-2", "--microbatches", "2"],
        "1f1b: num_ranks must be an int >= 1, got -2",
    ),
    (
        ["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "0"],
        "num_microbatches must be an int >= 1",
    ),
    (
        ["simulate", "--schedule", "interleaved", "--stages", "2", "--microbatches", "2", "--chunks", "0"],
        "stages_per_rank",
    ),
    ([*SIM, "--costs", "f=abc"], "cost f='abc' is not a number"),
    ([*SIM, "--costs", "f=-1"], "cost f=-1.0 must not be negative"),
    ([*SIM, "--costs", "f=nan"], "cost f='nan' must be a finite number"),
    ([*SIM, "--costs", "w=1e400"], "cost w='1e400' must be a finite number"),
    ([*SIM, "--costs", "zz=1"], "unknown cost 'zz' in 'zz=1'"),
    ([*SIM, "--costs", "overlap=2"], "overlap=2.0 must be within [0, 1]"),
    ([*SIM, "--costs", "mem_f=2,mem_b=1"], "mem_f + mem_b + mem_w = 2.5"),
    ([*SIM, "--overlap"], "--overlap applies to --schedule zbv only"),
    ([*DRAW, "-o", "/proc/x.png"], "cannot write PNG '/proc/x.png': No such file or directory"),
    (
        [*DRAW, "-o", "{tmp}/no/such/x.png"],
        "cannot write PNG '{tmp}/no/such/x.png': folder '{tmp}/no/such' does not exist",
    ),
    ([*DRAW, "-o", "{tmp}"], "PNG '{tmp}' is a folder; give a file name"),
    ([*DRAW, "-o", "{tmp}/x.png", "--trace", "/proc/t.json"], "cannot write trace '/proc/t.json'"),
    (["run", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--timeout=-1"], "--timeout -1.0 must be"),
    (["run", "--schedule", "1f1b", "--stages", "200", "--microbatches", "2"], "--stages = 200 is over the limit of 16"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("schedules")
    (tmp / "bad.csv").write_bytes(b"\xff\xfe\x00")
    (tmp / "q.csv").write_text("0F0,0Q1\n")
    (tmp / "dir.csv").mkdir()
    (tmp / "huge.txt").write_text("schedule x: stages=99999999999 microbatches=99999999999 placement=0\nrank 0: 0F0\n")
    save(build("1f1b", 2, 2), tmp / "ok.txt")
    bad_fields = GOOD.to_dict() | {"num_stages": "2"}
    bad_rows = GOOD.to_dict() | {"actions": ["0F0"]}
    for name, data in (("fields", bad_fields), ("rows", bad_rows)):
        blob = msgpack.packb({"format": "ms-layout", "version": 1, "kind": "Schedule", "data": data})
        (tmp / f"{name}.msgpack").write_bytes(blob)
    return tmp


@pytest.mark.parametrize(("argv", "message"), CLI_CASES, ids=[" ".join(a)[:70] for a, _ in CLI_CASES])
def test_cli_bad_input_is_one_line_exit_2(files, argv, message):
    run = run_script("ms_pipeline.cli", [a.format(tmp=files) for a in argv])
    run.assert_one_line_error("ms-pipeline", message.format(tmp=files), stdout_empty=False)
    assert not list(files.glob(".*tmp-*"))  # no temporary file left behind


def test_cli_huge_schedule_is_refused_before_building():
    # `--stages 1000 --microbatches 1000` ran for minutes; now it is refused at once, in little memory.
    run = run_script("ms_pipeline.cli", ["simulate", "--schedule", "zbv", "--stages", "1000", "--microbatches", "1000"])
    assert run.rc == 2
    assert "zbv (1000 ranks x 2) size 2000 stages x 1000 microbatches = 2000000 is over the limit" in run.stderr
    assert run.max_rss_mb < 150, f"peak RSS {run.max_rss_mb:.0f} MB"
    assert run.seconds < 10, f"took {run.seconds:.1f} s"


def test_cli_largest_allowed_schedule_runs_in_seconds():
    # 16384 stage x microbatch pairs: the default limit, e.g. ZB-H1 over 128 ranks x 128 microbatches.
    run = run_script("ms_pipeline.cli", ["simulate", "--schedule", "zbh1", "--stages", "128", "--microbatches", "128"])
    assert run.rc == 0, run.stderr
    assert run.seconds < 30, f"took {run.seconds:.1f} s"


def test_cli_failed_validation_prints_the_grid(files):
    path = files / "deadlock.txt"
    path.write_text("schedule x: stages=2 microbatches=1 placement=0,1\nrank 0: 0B0 0F0\nrank 1: 1F0 1B0\n")
    run = run_script("ms_pipeline.cli", ["validate", str(path)])
    assert run.rc == 2
    lines = run.stderr.splitlines()
    assert lines[0].startswith("ms-pipeline: error: ")
    assert any("<-- ERROR HERE" in line for line in lines[1:])  # the step x rank grid follows the message
    assert "Traceback" not in run.stderr
