"""The schedule IR: actions, text form, and the msgpack / CSV / file round trips."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ms_pipeline as mp
from ms_pipeline import Action, Kind, Schedule, ScheduleError

ATOM_KINDS = [k for k in Kind if k is not Kind.OVERLAP_F_B]


@st.composite
def actions(draw):
    if draw(st.booleans()):
        kind = draw(st.sampled_from(ATOM_KINDS))
        return Action(draw(st.integers(0, 99)), kind, draw(st.integers(0, 999)))
    fwd = Action(draw(st.integers(0, 99)), Kind.F, draw(st.integers(0, 999)))
    bwd = Action(draw(st.integers(0, 99)), draw(st.sampled_from([Kind.B, Kind.BW])), draw(st.integers(0, 999)))
    return Action.overlap(fwd, bwd)


@given(actions())
def test_action_text_round_trip(action):
    assert Action.parse(str(action)) == action


def test_action_spelling():
    assert str(Action(7, Kind.B, 3)) == "7B3"
    assert str(Action(2, Kind.BW, 10)) == "2BW10"
    assert str(Action(3, Kind.SEND_F, 1)) == "3SEND_F1"
    pair = Action.overlap(Action(0, Kind.F, 7), Action(7, Kind.B, 3))
    assert str(pair) == "(0F7;7B3)OVERLAP_F_B"
    assert Action.parse("(0F7;7B3)") == pair  # the suffix is optional on input
    assert Action.parse("12BW4") == Action(12, Kind.BW, 4)
    assert mp.parse_actions("0F0 0B0 0W0") == (Action(0, Kind.F, 0), Action(0, Kind.B, 0), Action(0, Kind.W, 0))


@pytest.mark.parametrize("text", ["", "F0", "0X1", "0F", "-1F0", "(0F1;0W1)", "(0B1;0F1)OVERLAP_F_B", "0F0 1F0"])
def test_bad_action_text_is_named(text):
    with pytest.raises(ScheduleError, match="cannot read action|OVERLAP_F_B pairs"):
        Action.parse(text)


def test_bad_action_fields():
    with pytest.raises(ScheduleError, match="unknown action kind 'Q'"):
        Action(0, "Q", 0)
    with pytest.raises(ScheduleError, match="microbatch must be an int >= 0, got -2"):
        Action(0, Kind.F, -2)
    with pytest.raises(ScheduleError, match="only an OVERLAP_F_B"):
        Action(0, Kind.F, 0, (Action(0, Kind.F, 0), Action(0, Kind.B, 0)))


def _all_builders():
    return [
        mp.gpipe(4, 6),
        mp.one_f_one_b(4, 8),
        mp.interleaved_1f1b(2, 5, stages_per_rank=3),
        mp.zero_bubble_h1(3, 7),
        mp.zero_bubble_v(4, 8),
        mp.zero_bubble_v(3, 9, overlap=True),
        mp.lower(mp.zero_bubble_v(2, 4)),
    ]


@pytest.mark.parametrize("schedule", _all_builders(), ids=lambda s: s.name)
def test_schedule_round_trips(schedule, tmp_path):
    assert Schedule.from_text(schedule.to_text()) == schedule
    assert Schedule.from_dict(schedule.to_dict()) == schedule
    assert mp.loads(mp.dumps(schedule)) == schedule
    assert mp.from_csv(mp.to_csv(schedule), name=schedule.name) == schedule
    for suffix in (".msgpack", ".csv", ".txt"):
        path = mp.save(schedule, tmp_path / f"s{suffix}")
        options = {"name": schedule.name} if suffix == ".csv" else {}
        assert mp.load(path, **options) == schedule


def test_text_form_reads_like_the_papers():
    text = mp.zero_bubble_v(4, 8).to_text()
    assert text.splitlines()[0] == "schedule zbv: stages=8 microbatches=8 placement=0,1,2,3,3,2,1,0"
    assert text.splitlines()[1].startswith("rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7B0 7W0")
    assert text.splitlines()[4].startswith("rank 3: 3F0 4F0 3F1 4F1")


def test_torch_csv_dialect_maps_letters():
    # PyTorch writes I for the input gradient and B for the full backward.
    text = "0F0,0I0,,0W0,0F1,0B1\n1F0,1I0,1W0,1F1,1B1\n"
    s = mp.from_csv(text, dialect="torch")
    assert mp.format_actions(s.actions[0]) == "0F0 0B0 0W0 0F1 0BW1"
    assert s.stage_to_rank == (0, 1) and s.num_microbatches == 2
    mp.validate(s)
    with pytest.raises(ScheduleError, match="UNSHARD"):
        mp.from_csv("0UNSHARD,0F0\n", dialect="torch")


def test_csv_placement_conflict_is_named():
    with pytest.raises(ScheduleError, match="stage 0 computes on rank 0 and on rank 1"):
        mp.from_csv("0F0,0BW0\n0F1,0BW1\n")


def test_schedule_shape_errors():
    with pytest.raises(ScheduleError, match="stage_to_rank has 1 entries for 2 stages"):
        Schedule("x", 2, 1, (0,), ((),))
    with pytest.raises(ScheduleError, match=r"names ranks \[3\] outside 0..1"):
        Schedule("x", 2, 1, (0, 3), ((), ()))
    with pytest.raises(ScheduleError, match="rank 0 step 1: action 0F5 is outside 2 stages x 2 microbatches"):
        Schedule("x", 2, 2, (0, 1), ((Action(0, Kind.F, 0), Action(0, Kind.F, 5)), ()))
    with pytest.raises(ScheduleError, match="one word"):
        Schedule("two words", 1, 1, (0,), ((),))


def test_loads_refuses_foreign_bytes():
    with pytest.raises(ScheduleError, match="not an ms-layout blob"):
        mp.loads(b"\x00garbage")
    from ms_layout import ParallelConfig, dumps

    with pytest.raises(ScheduleError, match="expected a Schedule"):
        mp.loads(dumps(ParallelConfig(dp=2)))


def test_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "sched.msgpack"
    mp.save(mp.one_f_one_b(2, 2), path)
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        mp.save(mp.zero_bubble_v(4, 8), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["sched.msgpack"]  # no temporary left behind
    with pytest.raises(ScheduleError, match="cannot tell the format"):
        mp.save(mp.one_f_one_b(2, 2), tmp_path / "sched.json")
