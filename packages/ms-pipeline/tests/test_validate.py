"""The validator accepts every builder's schedule and rejects hand-broken ones, naming the action."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ms_pipeline as mp
from ms_pipeline import Action, Kind, Schedule, ScheduleError

SIZES = [(p, m) for p in (2, 4, 8) for m in range(p, 4 * p + 1)]
NAMES = ["gpipe", "1f1b", "interleaved", "zbh1", "zbv", "zbv-adaptive"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p,m", SIZES, ids=[f"p{p}m{m}" for p, m in SIZES])
def test_every_builder_is_valid(name, p, m):
    schedule = mp.build(name, p, m)
    assert mp.validate(schedule) is schedule  # validation checks and never lowers
    lowered = mp.lower(schedule)
    assert lowered.is_lowered == (p > 1)
    assert mp.validate(lowered) is lowered  # a lowered schedule validates too, its transfers stepped


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 40), v=st.integers(2, 4), overlap=st.booleans())
def test_multi_chunk_builders_are_valid_for_any_size(p, m, v, overlap):
    # beyond the required grid: m below p (ZBV pads to 2p-1 and drops), odd sizes, more chunks
    mp.validate(mp.interleaved_1f1b(p, m, stages_per_rank=v))
    mp.validate(mp.zero_bubble_v(p, m, overlap=overlap))
    mp.validate(mp.zero_bubble_h1(p, m))


def test_zbv_places_chunks_in_a_v():
    s = mp.zero_bubble_v(4, 8)
    assert s.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert [s.stages_of(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    # the turn of the V is local: no transfer between stages 3 and 4
    lowered = mp.lower(s)
    assert not any(a.kind is Kind.SEND_F and a.stage == 3 for a in lowered.actions[3])
    assert Action(2, Kind.SEND_F, 0) in lowered.actions[2] and Action(3, Kind.RECV_F, 0) in lowered.actions[3]


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (3, 6), (3, 8), (4, 8), (4, 12)])
def test_zbv_overlap_pairs_every_steady_forward(p, m):
    """Rank r runs 2m forwards: 3p - r - 1 in the warm-up (PyTorch's ZBV counts), the last one
    alone; every other one is paired with a backward of the other chunk: 2m - 3p + r pairs."""
    s = mp.zero_bubble_v(p, m, overlap=True)
    for r in range(p):
        pairs = [a for a in s.actions[r] if a.kind is Kind.OVERLAP_F_B]
        assert len(pairs) == 2 * m - 3 * p + r, (r, mp.format_actions(s.actions[r]))


def test_zbv_overlap_pairs_the_steady_phase():
    s = mp.zero_bubble_v(4, 12, overlap=True)
    pairs = [a for a in s.actions[0] if a.kind is Kind.OVERLAP_F_B]
    assert len(pairs) == 12
    assert all(a.parts[0].kind is Kind.F and a.parts[1].kind is Kind.B for a in pairs)
    assert all(a.parts[0].stage != a.parts[1].stage for a in pairs)  # F of one chunk with B of the other
    plain = mp.zero_bubble_v(4, 12)
    flat = lambda sched: sorted(str(p) for acts in sched.actions for a in acts for p in a.computes())  # noqa: E731
    assert flat(s) == flat(plain)  # the same computations, regrouped


def _replace_rank(schedule: Schedule, rank: int, text: str) -> Schedule:
    actions = list(schedule.actions)
    actions[rank] = mp.parse_actions(text)
    return dataclasses.replace(schedule, actions=tuple(actions))


def _swap(schedule: Schedule, rank: int, i: int, j: int) -> Schedule:
    acts = list(schedule.actions[rank])
    acts[i], acts[j] = acts[j], acts[i]
    return _replace_rank(schedule, rank, mp.format_actions(acts))


def test_backward_before_its_forward_is_named():
    s = _swap(mp.one_f_one_b(4, 8), 3, 0, 1)  # last rank: 3BW0 before 3F0
    with pytest.raises(ScheduleError) as err:
        mp.validate(s)
    msg = str(err.value)
    assert "rank 3 step 0: 3BW0 needs 3F0, which rank 3 runs later (step 1)" in msg
    assert ">>3BW0" in msg and "<-- ERROR HERE" in msg


def test_weight_pass_before_input_pass_is_named():
    s = mp.zero_bubble_h1(2, 2)  # rank 1: 1F0 1B0 1F1 1B1 1W0 1W1
    s = _replace_rank(s, 1, "1F0 1W0 1B0 1F1 1B1 1W1")
    with pytest.raises(ScheduleError, match=r"rank 1 step 1: 1W0 needs 1B0, which rank 1 runs later \(step 2\)"):
        mp.validate(s)


def test_duplicate_and_missing_actions_are_named():
    s = mp.one_f_one_b(2, 3)
    dup = _replace_rank(s, 0, mp.format_actions(s.actions[0]) + " 0F1")
    with pytest.raises(ScheduleError, match=r"0F1 appears 2 times \(rank 0 step 1, rank 0 step 6\)"):
        mp.validate(dup)
    missing = _replace_rank(s, 1, mp.format_actions(a for a in s.actions[1] if str(a) != "1BW2"))
    with pytest.raises(ScheduleError, match="1B2 is missing: stage 1 microbatch 2 never runs a backward"):
        mp.validate(missing)
    no_w = _replace_rank(mp.zero_bubble_h1(2, 2), 0, "0F0 0F1 0B0 0W0 0B1")
    with pytest.raises(ScheduleError, match="0W1 is missing"):
        mp.validate(no_w)
    both = _replace_rank(s, 1, mp.format_actions(s.actions[1]).replace("1BW0", "1B0 1BW0"))
    with pytest.raises(ScheduleError, match="1B0 and 1BW0 both compute"):
        mp.validate(both)


def test_action_on_the_wrong_rank_is_named():
    s = mp.one_f_one_b(2, 2)
    s = _replace_rank(s, 0, mp.format_actions(s.actions[0]) + " 1F1")
    with pytest.raises(ScheduleError, match="rank 0 step 4: 1F1 runs on rank 0, but stage 1 is on rank 1"):
        mp.validate(s)


def test_cross_rank_cycle_is_a_deadlock_naming_both_ends():
    # rank 1 starts with microbatch 1, which rank 0 forwards only after the backward of
    # microbatch 0, which needs rank 1's 1BW0, queued behind 1F1: a cycle across two ranks.
    s = Schedule(
        "bad",
        2,
        2,
        (0, 1),
        (mp.parse_actions("0F0 0BW0 0F1 0BW1"), mp.parse_actions("1F1 1F0 1BW0 1BW1")),
    )
    with pytest.raises(ScheduleError) as err:
        mp.validate(s)
    msg = str(err.value)
    assert "deadlock" in msg
    assert "rank 0 step 1: 0BW0 waits for 1BW0 (rank 1 step 2)" in msg
    assert "rank 1 step 0: 1F1 waits for 0F1 (rank 0 step 2)" in msg
    assert ">>0BW0" in msg and ">>1F1" in msg


def test_hand_lowered_schedule_missing_a_receive_deadlocks_in_the_step_simulation():
    lowered = mp.lower(mp.one_f_one_b(2, 2))
    acts = [a for a in lowered.actions[1] if str(a) != "1RECV_F1"]
    broken = dataclasses.replace(lowered, actions=(lowered.actions[0], tuple(acts)))
    with pytest.raises(ScheduleError, match="1F1 waits for 1RECV_F1 on this rank"):
        mp.step_simulate(broken)
    unreceived = dataclasses.replace(
        lowered, actions=(lowered.actions[0] + (Action(0, Kind.SEND_F, 1),), lowered.actions[1])
    )
    with pytest.raises(ScheduleError, match="0SEND_F1 is sent but never received"):
        mp.step_simulate(unreceived)


def test_pair_with_its_own_forward_is_rejected():
    pair = Action.overlap(Action(1, Kind.F, 0), Action(1, Kind.BW, 0))
    s = Schedule("bad", 2, 1, (0, 1), (mp.parse_actions("0F0 0BW0"), (pair,)))
    with pytest.raises(ScheduleError, match="pairs a backward with its own forward"):
        mp.validate(s)


def test_step_simulation_grid_has_one_row_per_step():
    grid = mp.step_simulate(mp.lower(mp.one_f_one_b(2, 1)))
    assert [[str(a) if a else "." for a in row] for row in grid] == [
        ["0F0", "."],
        ["0SEND_F0", "."],
        [".", "1RECV_F0"],
        [".", "1F0"],
        [".", "1BW0"],
        [".", "1SEND_B0"],
        ["0RECV_B0", "."],
        ["0BW0", "."],
    ]


def test_format_grid_windows_around_the_error():
    s = mp.zero_bubble_v(4, 16)
    text = mp.format_grid(s, {(2, 30)})
    assert text.splitlines()[0].startswith("step  rank 0")
    assert "  ..." in text and "<-- ERROR HERE" in text
    assert len(text.splitlines()) < 20


def test_one_function_names_a_message_for_lowering_and_runtime():
    """A send and the receive that waits for it name the same Message; its tag is unique per step."""
    from ms_pipeline.messages import Message, message_of

    lowered = mp.lower(mp.zero_bubble_v(2, 4))
    sends = [a for r in lowered.actions for a in r if a.kind in (Kind.SEND_F, Kind.SEND_B)]
    recvs = [a for r in lowered.actions for a in r if a.kind in (Kind.RECV_F, Kind.RECV_B)]
    assert sorted(map(message_of, sends)) == sorted(map(message_of, recvs)) and sends
    tags = {message_of(a).tag(4) for a in sends}
    assert len(tags) == len(sends)
    msg = message_of(Action(2, Kind.RECV_B, 3))
    assert msg == Message(Kind.B, 3, 3) and msg.receiver == 2 and str(msg) == "3SEND_B3"
    with pytest.raises(ValueError, match="not a send or a receive"):
        message_of(Action(0, Kind.F, 0))
