"""DP + EP lockstep (numpy only): ranks whose steps hold different numbers of forwards and of
multi-step rounds still meet collective by collective. Two ranks run as threads over a group whose
all-gather records what each rank called it for; every call must find the other rank in the same
kind of call (an agreement meets an agreement, an expert exchange meets an exchange)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ms_vllm.lockstep import Lockstep, OneByOne


class ThreadGroup:
    """An all-gather between threads that fails when the ranks call it for different things."""

    def __init__(self, size: int):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=10)
        self.mismatches: list[tuple] = []

    def member(self, rank: int, log: list[str]):
        group = self

        class Member:
            def all_gather(self, array, kind="agree"):
                group.slots[rank] = (kind, np.asarray(array))
                group.barrier.wait()
                got = list(group.slots)
                group.barrier.wait()
                kinds = [k for k, _ in got]
                if len(set(kinds)) > 1:
                    group.mismatches.append(tuple(kinds))
                log.append(kind)
                return np.concatenate([a for _, a in got])

        return Member()


def _rank(group: ThreadGroup, rank: int, steps, log: list[str]) -> None:
    """Each step: (forwards of its first agreement, rounds it plans, rounds it actually runs,
    forwards per round). A forward is one expert exchange."""
    member = group.member(rank, log)

    def forward():
        member.all_gather(np.zeros(1, np.int64), kind="exchange")

    lockstep = Lockstep(member, dummy_forward=forward)
    for first, planned, run, per_round in steps:
        with lockstep.forwards(first, rounds=planned):
            for _ in range(first):
                forward()
        for _ in range(run):
            with lockstep.round(), lockstep.forwards(per_round):
                for _ in range(per_round):
                    forward()
        lockstep.settle()


def _run(steps_per_rank) -> tuple[ThreadGroup, list[list[str]]]:
    group = ThreadGroup(len(steps_per_rank))
    logs = [[] for _ in steps_per_rank]
    threads = [threading.Thread(target=_rank, args=(group, r, s, logs[r])) for r, s in enumerate(steps_per_rank)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return group, logs


def test_ranks_with_different_rounds_meet_call_by_call():
    # rank 0: a decode step planning 3 extra rounds, its requests end after 2; then a prefill in 2 parts
    # rank 1: a prefill (1 part, no rounds); then a decode step with 1 round of 2 parts
    group, logs = _run([
        [(1, 3, 2, 1), (2, 0, 0, 0)],
        [(1, 0, 0, 0), (1, 1, 1, 2)],
    ])  # fmt: skip
    assert group.mismatches == []
    assert logs[0] == logs[1]
    # step 1: agree, 1 exchange, then 3 rounds (rank 0 ran 2, both owe the third) of 1 exchange each but
    # the last (empty on both); step 2: agree, 2 exchanges, 1 round of 2 exchanges
    assert logs[0].count("exchange") == 1 + 2 + 2 + 2


def _drafting_rank(group: ThreadGroup, rank: int, phases: list[int], log: list[str]) -> None:
    """Each phase: this rank's own forwards, known one at a time (MTP drafting), then drain."""
    member = group.member(rank, log)

    def forward():
        member.all_gather(np.zeros(1, np.int64), kind="exchange")

    pairing = OneByOne(member, dummy_forward=forward)
    for own in phases:
        for _ in range(own):
            with pairing.forward():
                forward()
        pairing.drain()


def test_forwards_learned_one_at_a_time_pair_up():
    group = ThreadGroup(2)
    logs = [[], []]
    phases = [[2, 0, 1], [0, 3, 1]]
    threads = [threading.Thread(target=_drafting_rank, args=(group, r, phases[r], logs[r])) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert group.mismatches == [] and logs[0] == logs[1]
    assert logs[0].count("exchange") == 2 + 3 + 1  # per phase, the larger rank's count


def test_a_round_nobody_announced_is_an_error():
    group = ThreadGroup(1)
    lockstep = Lockstep(group.member(0, []), dummy_forward=lambda: None)
    with pytest.raises(RuntimeError, match="did not announce"):
        with lockstep.round():
            pass


def test_without_a_group_nothing_is_agreed():
    lockstep = Lockstep(None, dummy_forward=lambda: pytest.fail("no dummy forwards without a group"))
    with lockstep.forwards(1, rounds=3), lockstep.round():
        pass
    lockstep.settle()
    assert lockstep.rounds_owed == 0
