"""The simulator reproduces the published bubble formulas and memory claims.

References: Narayanan et al. 2021 (1F1B), Qi et al. 2024 "Zero Bubble Pipeline Parallelism"
(ZB-H1, ZB-V), the sail-sg README table, DeepSeek's DualPipe README (1F1B (PP-1)(F+B),
ZB1P (PP-1)(F+B-2W) with B there the full backward).
"""

from __future__ import annotations

import pytest

import ms_pipeline as mp
from ms_pipeline import Action, CostModel, Event, Kind, ScheduleError

GRID = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 3 * p, 4 * p)]
COSTS = [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 2.0, 1.0), (2.0, 1.0, 0.5), (1.0, 0.9972, 0.6321)]


def run(name, p, m, costs=None, **kw):
    schedule = mp.build(name, p, m, **kw)
    costs = costs or CostModel()
    return mp.simulate(schedule, costs.split(schedule.stages_per_rank))


@pytest.mark.parametrize("p,m", GRID)
def test_equal_costs_bubble_rates(p, m):
    assert run("1f1b", p, m).bubble_rate == pytest.approx((p - 1) / (m + p - 1))
    assert run("zbh1", p, m).bubble_rate == pytest.approx((p - 1) / (3 * m + p - 1))
    assert run("gpipe", p, m).bubble_rate == pytest.approx((p - 1) / (m + p - 1))
    zbv, zbh1 = run("zbv", p, m), run("zbh1", p, m)
    if m >= 2 * p - 1:
        # ZeroBubbleV: rank i idles only before its first action (i chunk forwards) and after its last
        assert zbv.makespan == pytest.approx(3 * m + (p - 1) / 2)
        assert zbv.bubble_rate == pytest.approx((p - 1) / (6 * m + p - 1))
        # ... which the Zero Bubble authors do not count: their rate is exactly 0 (README table: ZBV 0)
        assert zbv.bubble_rate_zb == pytest.approx(0.0, abs=1e-12)
        assert zbv.bubble_rate < zbh1.bubble_rate
    else:
        # fewer than 2p-1 microbatches cannot fill the V: the pattern is padded and holes remain;
        # at m = p it is exactly as fast as ZB-H1, never slower
        assert zbv.makespan <= zbh1.makespan + 1e-9


@pytest.mark.parametrize("f,b,w", COSTS)
@pytest.mark.parametrize("p,m", [(4, 8), (8, 16), (8, 32)])
def test_idle_time_per_rank_formulas(f, b, w, p, m):
    costs = CostModel(f=f, b=b, w=w)
    work = m * (f + b + w)
    one = run("1f1b", p, m, costs)
    assert one.makespan - work == pytest.approx((p - 1) * (f + b + w))  # idle of every rank
    assert all(busy == pytest.approx(work) for busy in one.busy)
    zb = run("zbh1", p, m, costs)
    assert zb.makespan - work == pytest.approx((p - 1) * (f + b - w))  # the paper's T_W <= T_F case
    assert run("zbv", p, m, costs).makespan < zb.makespan


def test_zero_bubble_authors_profile_w_063f():
    """The authors' measured costs (T_B ~ T_F, T_W = 0.63 T_F, comm 1.6% of T_F): ZBV < ZB-H1 < 1F1B."""
    profile = CostModel.zb_profile()
    assert profile.w == pytest.approx(0.632, abs=1e-3) and profile.b == pytest.approx(0.997, abs=1e-3)
    for p, m in [(4, 8), (8, 24), (8, 32)]:
        rates = {n: run(n, p, m, profile) for n in ("1f1b", "zbh1", "zbv")}
        assert rates["zbv"].bubble_rate < rates["zbh1"].bubble_rate < rates["1f1b"].bubble_rate
        assert rates["zbv"].makespan < rates["zbh1"].makespan < rates["1f1b"].makespan
        # without comm the ZB-H1 idle is (p-1)(T_F + T_B - T_W) here too
        no_comm = CostModel(f=1.0, b=profile.b, w=profile.w, mem_b=profile.mem_b, mem_w=profile.mem_w)
        zb = run("zbh1", p, m, no_comm)
        assert zb.makespan - m * (1 + profile.b + profile.w) == pytest.approx((p - 1) * (1 + profile.b - profile.w))


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("mem_b", [-0.5, -0.55, 0.0])  # 0: W keeps every activation until it runs
def test_zbv_activation_memory_is_not_above_1f1b(p, m, mem_b):
    costs = CostModel(mem_f=1.0, mem_b=mem_b, mem_w=-1.0 - mem_b)
    one = run("1f1b", p, m, costs)
    assert max(one.peak_activation) == pytest.approx(min(p, m))  # p microbatches on rank 0
    for name in ("zbv", "zbh1"):
        assert max(run(name, p, m, costs).peak_activation) <= max(one.peak_activation) + 1e-9
    assert max(run("gpipe", p, m, costs).peak_activation) == pytest.approx(m)


def test_zbv_memory_is_balanced_across_ranks():
    peaks = run("zbv", 4, 16).peak_activation
    assert peaks == pytest.approx((4.0,) * 4)  # 1F1B: 4, 3, 2, 1


def test_comm_latency_costs_time_except_at_the_turn_of_the_v():
    slow = CostModel(comm=0.25)
    assert run("1f1b", 4, 8, slow).makespan > run("1f1b", 4, 8).makespan
    # one rank holding both chunks of the V: nothing crosses ranks, latency is irrelevant
    assert run("zbv", 1, 4, slow).makespan == pytest.approx(run("zbv", 1, 4).makespan)


def test_overlapped_pairs_cost_both_halves_unless_overlap_is_modelled():
    plain = run("zbv", 4, 16)
    paired = run("zbv", 4, 16, overlap=True)
    assert paired.makespan >= plain.makespan - 1e-9  # pairing alone only constrains the order
    hidden = run("zbv", 4, 16, CostModel(overlap=1.0), overlap=True)
    assert hidden.makespan < plain.makespan  # the pair runs in max(F, B) when fully overlapped


def test_timeline_is_consistent():
    result = run("zbh1", 3, 5)
    by_rank = {}
    for e in result.timeline:
        by_rank.setdefault(e.rank, []).append(e)
    for events in by_rank.values():
        for a, b in zip(events, events[1:]):
            assert a.end <= b.start + 1e-12  # one action at a time, in list order
    ends = {str(e.action): e.end for e in result.timeline}
    starts = {str(e.action): e.start for e in result.timeline}
    assert starts["1F0"] >= ends["0F0"] and starts["0B0"] >= ends["1B0"] and starts["2W4"] >= ends["2B4"]
    data = result.to_dict(timeline=True)
    assert set(data) >= {"makespan", "bubble_rate", "peak_activation", "timeline"}


def test_bubbles_of_a_hand_timeline():
    a = mp.Action.parse
    events = [Event(0, a("0F0"), 0, 1), Event(1, a("1F0"), 1, 2), Event(1, a("1BW0"), 2, 4), Event(0, a("0BW0"), 4, 6)]
    b = mp.Bubbles.of(events, 2)
    assert b.makespan == 6 and b.busy == (3, 3)
    assert b.bubble_rate == pytest.approx(0.5)
    assert b.bubble_rate_zb == pytest.approx(0.5)  # rank 0 idles 3 of its 6


def test_cost_model_checks_and_parsing():
    assert CostModel.parse("f=2,b=1,w=0.5,comm=0.1") == CostModel(f=2, b=1, w=0.5, comm=0.1)
    assert CostModel.parse("mem_f=2") == CostModel(mem_f=2, mem_b=-1, mem_w=-1)
    with pytest.raises(ScheduleError, match="unknown cost 'x'"):
        CostModel.parse("x=1")
    with pytest.raises(ScheduleError, match="cost f=abc is not a number|cost f='abc' is not a number"):
        CostModel.parse("f=abc")
    with pytest.raises(ScheduleError, match="cost b=-1"):
        CostModel(b=-1)
    with pytest.raises(ScheduleError, match="mem_f \\+ mem_b \\+ mem_w = 0.5"):
        CostModel(mem_f=1, mem_b=-0.5, mem_w=0)
    with pytest.raises(ScheduleError, match="cost f has 3 values for a schedule of 4 stages"):
        mp.simulate(mp.one_f_one_b(4, 4), CostModel(f=(1, 1, 1)))
    with pytest.raises(ScheduleError, match="cannot split per-stage costs"):
        CostModel(f=(1, 2)).split(2)


@pytest.mark.parametrize("m", [4, 8, 16])
def test_per_stage_costs_slowest_stage_dominates(m):
    """1F1B on 4 stages, stage 2 twice as slow (f 2, fused b+w 4; the others 1 and 2). Stage 2
    waits 2 for the first forward (stages 0, 1), runs F0 and F1, then waits 1: its BW0 needs
    stage 3's F0 + BW0 (3 units from t = 4, so t = 7, its F1 ended at 6); then it is never idle
    (6 per microbatch); after its last BW stages 1 and 0 run theirs (2 + 2)."""
    uneven = CostModel(f=(1, 1, 2, 1), b=(1, 1, 2, 1), w=(1, 1, 2, 1))
    result = mp.simulate(mp.one_f_one_b(4, m), uneven)
    assert result.makespan == 2 + 1 + 6 * m + 4


@pytest.mark.parametrize("p", [2, 4, 8])
def test_adaptive_zbv_fills_the_v_even_with_few_microbatches(p):
    """The fixed pattern leaves holes below 2p-1 microbatches; ordering by the clock closes them
    at m = p and keeps ZeroBubbleV strictly below ZB-H1 for every m >= p."""
    equal = CostModel().split(2)
    for m in range(p, 2 * p + 1):
        adaptive = mp.simulate(mp.zero_bubble_v_adaptive(p, m, equal), equal)
        fixed = mp.simulate(mp.zero_bubble_v(p, m), equal)
        assert adaptive.makespan <= fixed.makespan + 1e-9
        assert adaptive.makespan < run("zbh1", p, m).makespan
        assert max(adaptive.peak_activation) <= p + 1e-9
    at_p = mp.simulate(mp.zero_bubble_v_adaptive(p, p, equal), equal)
    assert at_p.makespan == pytest.approx(3 * p + (p - 1) / 2)  # idle only at the edges


@pytest.mark.parametrize("p,m", [(4, 4), (4, 8), (8, 8), (8, 24)])
def test_adaptive_zbv_is_never_slower_than_the_fixed_pattern(p, m):
    profile = CostModel.zb_profile().split(2)
    adaptive = mp.simulate(mp.zero_bubble_v_adaptive(p, m, profile), profile)
    fixed = mp.simulate(mp.zero_bubble_v(p, m), profile)
    assert adaptive.makespan <= fixed.makespan + 1e-9
    assert max(adaptive.peak_activation) <= max(run("1f1b", p, m, CostModel.zb_profile()).peak_activation) + 1e-9


def test_fusing_adjacent_backwards_keeps_the_bubble_fillers_and_is_priced_by_bw():
    """ZBV p=2 m=8: every B its own W follows becomes one BW, the cool-down W's stay apart; the
    result validates, and with a fused backward cheaper than B + W the simulator prices it so."""
    import ms_pipeline as mp

    zbv = mp.zero_bubble_v(2, 8)
    fused = mp.fuse_adjacent_backward(zbv)
    assert fused.name == f"{zbv.name}+fused"
    mp.validate(fused)
    kinds = [[a.kind.value for a in r] for r in fused.actions]
    assert [k.count("BW") for k in kinds] == [16, 13]  # rank 1 keeps 1W6, 2W7, 1W7 apart (its cool-down)
    assert [k.count("W") for k in kinds] == [0, 3]
    costs = dict(f=20.0, b=28.0, w=23.0, comm=0.0)  # measured per half-stage, ms (d=256, 2 layers)
    # fusing alone delays dx by T_W and loses; with the fused pass 11 ms cheaper than B + W it wins
    assert mp.simulate(zbv, mp.CostModel(**costs)).makespan == pytest.approx(1164.0)
    assert mp.simulate(fused, mp.CostModel(**costs)).makespan == pytest.approx(1210.0)
    assert mp.simulate(fused, mp.CostModel(**costs, bw=40.0)).makespan == pytest.approx(1045.0)
    with pytest.raises(mp.ScheduleError, match="before lowering"):
        mp.fuse_adjacent_backward(mp.lower(zbv))
    with pytest.raises(mp.ScheduleError, match="cost bw"):
        mp.CostModel(bw=-1.0)


def test_fuse_backward_moves_each_chosen_w_up_to_its_b():
    zbv = mp.zero_bubble_v(2, 4)
    one = mp.fuse_backward(zbv, [(3, 0)])
    mp.validate(one)
    assert "3BW0" in mp.format_actions(one.actions[0]).split()
    assert not {"3B0", "3W0"} & set(mp.format_actions(one.actions[0]).split())
    every = mp.fuse_backward(zbv)
    assert {a.kind for r in every.actions for a in r} == {Kind.F, Kind.BW}
    assert sum(len(r) for r in every.actions) == 2 * 4 * 4  # F and BW per stage and microbatch
    with pytest.raises(ScheduleError, match=r"\(5, 0\)"):
        mp.fuse_backward(zbv, [(5, 0)])
    with pytest.raises(ScheduleError, match="before lowering"):
        mp.fuse_backward(mp.lower(zbv))


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8)])
def test_fuse_where_faster_never_loses_to_either_fixed_choice(p, m):
    """Under every cost profile, the chosen fusions simulate no slower than all-split ZBV, than
    fusing the adjacent pairs, and than fusing everything; the result validates."""
    zbv = mp.zero_bubble_v(p, m)
    for f, b, w in COSTS:
        for ratio in (0.6, 0.8, 1.0, 1.2):  # BW / (B + W): the fused pass cheaper, equal, dearer
            costs = CostModel(f=f, b=b, w=w, bw=ratio * (b + w), comm=0.05)
            auto = mp.fuse_where_faster(zbv, costs)
            assert auto.name == f"{zbv.name}+auto"
            mp.validate(mp.lower(auto))
            got = mp.simulate(auto, costs).makespan
            for other in (zbv, mp.fuse_adjacent_backward(zbv), mp.fuse_backward(zbv)):
                assert got <= mp.simulate(other, costs).makespan * (1 + 1e-9), (f, b, w, ratio, other.name)


def test_fuse_where_faster_fuses_all_when_w_is_free_inside_bw_and_keeps_the_bubble_fillers_when_not():
    zbv = mp.zero_bubble_v(2, 8)
    free = mp.fuse_where_faster(zbv, CostModel(f=1.0, b=1.0, w=1.0, bw=1.0))
    assert sum(a.kind is Kind.W for r in free.actions for a in r) == 0
    # the measured CPU profile of bench_pipeline (ms per half stage, BW 0.8 x (B + W)): it fuses
    # all but the W's that fill rank 1's cool-down and beats both fixed choices
    costs = CostModel(f=27.0, b=33.0, w=22.0, bw=44.0, comm=2.8)
    auto = mp.fuse_where_faster(zbv, costs)
    split_w = sum(a.kind is Kind.W for r in auto.actions for a in r)
    assert 0 < split_w < sum(a.kind is Kind.W for r in mp.fuse_adjacent_backward(zbv).actions for a in r) + 1
    assert mp.simulate(auto, costs).makespan < mp.simulate(mp.fuse_adjacent_backward(zbv), costs).makespan
    assert mp.simulate(auto, costs).makespan < mp.simulate(zbv, costs).makespan
    with pytest.raises(ScheduleError, match="tolerance"):
        mp.fuse_where_faster(zbv, costs, tolerance=-1.0)


def test_cost_model_from_events_recovers_the_costs_that_made_them():
    costs = CostModel(f=[1.0, 2.0, 3.0, 4.0], b=[2.0, 2.5, 3.0, 3.5], w=[0.5, 1.0, 1.5, 2.0], comm=0.1)
    zbv = mp.zero_bubble_v(2, 4)
    events = mp.simulate(zbv, costs).timeline
    got = CostModel.from_events(events, 4, comm=0.1)
    for name in ("f", "b", "w"):
        assert got.at(name, 3) == pytest.approx(costs.at(name, 3))
        assert [got.at(name, s) for s in range(4)] == pytest.approx([costs.at(name, s) for s in range(4)])
    assert [got.at("bw", s) for s in range(4)] == pytest.approx([costs.at("b", s) + costs.at("w", s) for s in range(4)])
    fused = mp.simulate(mp.fuse_backward(zbv, [(0, 0)]), CostModel(f=1.0, b=1.0, w=1.0, bw=1.5)).timeline
    assert CostModel.from_events(fused, 4).at("bw", 0) == pytest.approx(1.5)
    with pytest.raises(ScheduleError, match="0W"):
        CostModel.from_events([e for e in events if e.action.kind is not Kind.W], 4)


def test_split_pairs_gives_each_half_its_own_transfers():
    """The runtime runs a 1B1F pair as its halves: the forward's send leaves before the backward
    half computes and the backward's receive is waited for after the forward half; lowered as one
    action, both receives come before the pair and both sends after it."""

    paired = mp.zero_bubble_v(2, 8, overlap=True)
    split = mp.split_pairs(paired)
    assert split.name == paired.name and mp.split_pairs(mp.zero_bubble_v(2, 8)) == mp.zero_bubble_v(2, 8)
    assert [[p for a in r for p in a.computes()] for r in paired.actions] == [list(r) for r in split.actions]
    assert not any(a.kind is Kind.OVERLAP_F_B for r in split.actions for a in r)
    mp.validate(split)
    assert mp.split_pairs(mp.lower(paired)) == mp.lower(split)  # a lowered schedule is lowered again
    pairs = [a for a in paired.actions[0] if a.kind is Kind.OVERLAP_F_B]
    assert len(pairs) >= 4
    whole, halves = list(mp.lower(paired).actions[0]), list(mp.lower(split).actions[0])
    for pair in pairs:
        fwd, bwd = pair.parts
        send_f, recv_b = Action(fwd.stage, Kind.SEND_F, fwd.microbatch), Action(bwd.stage, Kind.RECV_B, bwd.microbatch)
        if send_f in halves:
            assert halves.index(fwd) < halves.index(send_f) < halves.index(bwd)
            assert whole.index(send_f) > whole.index(pair)
        if recv_b in halves:
            assert halves.index(fwd) < halves.index(recv_b) < halves.index(bwd)
            assert whole.index(recv_b) < whole.index(pair)
    # the transfer latency is what the split saves: equal without one, less with one
    for comm, saves in ((0.0, False), (20.0, True)):
        costs = CostModel(f=20.0, b=28.0, w=23.0, comm=comm)
        a, b = mp.simulate(paired, costs).makespan, mp.simulate(split, costs).makespan
        assert b < a if saves else b == pytest.approx(a)
