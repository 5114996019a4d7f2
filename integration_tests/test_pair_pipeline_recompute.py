"""ms-pipeline x ms-recompute: the ZeroBubbleV step of the tiny DeepSeek-V3 on 2 gloo ranks, with
ms-recompute's paired full-layer plan applied to each rank's decoder layers, gives the gradients of
the same step without recompute (within RECOMPUTE_RTOL of each tensor's scale: recompute replays
the same ops, yet the loss was measured 2.4e-7 apart, so bit-identity is not asserted) and of the
single-process reference (within ``_tiny.RTOL``); and
the recompute really ran, once per layer group per gradient call of ms-pipeline's split B/W
(counted from the recompute trace against the runtime's own actions)."""

from __future__ import annotations

import _tiny
import pytest

from ms_layout.testing import assert_close

pytest.importorskip("mindspore")
pytest.importorskip("torch")
pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch, pytest.mark.timeout(600)]
# with and without recompute, the same rank and step: the forward is replayed op for op and only the
# backward graph groups differently (measured: losses 1.2e-7 to 2.4e-7 apart, <= 4e-8 of the ~5.8
# loss; gradients bit-identical): 64 u (~3.8e-6) of each tensor's scale, 16x below _tiny.RTOL
RECOMPUTE_RTOL = 64 * 2.0**-24


def _expected_recomputes(runtime, groups_per_stage: dict[int, int]) -> int:
    """One replay per layer group per gradient call of a stage: B (on stage 0 only when it
    differentiates weights, i.e. with the stored dW), W only when it re-runs the stage
    (dw="recompute"), fused BW, and the one-time check of the stored dW."""
    total = 0
    for action in (part for a in runtime.actions for part in (a.parts or (a,))):
        stored = runtime.stages[action.stage].dw == "stored"
        calls = {"B": 1 if stored or action.stage != 0 else 0, "W": 0 if stored else 1, "BW": 1}
        total += calls.get(action.kind.value, 0) * groups_per_stage.get(action.stage, 0)
    checks = [s for s, stage in runtime.stages.items() if stage.verified]
    return total + sum(groups_per_stage.get(s, 0) for s in checks)


def _rank(group):
    from ms_recompute import RecomputePlan
    from ms_recompute.runtime import apply_plan

    net = _tiny.model()
    inputs, labels = _tiny.data(net.config.vocab_size)
    plain = _tiny.pipeline_runtime(group, net)
    plain_loss = plain.step(inputs, labels).loss
    plain_grads = plain.grads()

    # this rank's decoder layers, stage by stage; pairs must not cross a stage (one ms.grad call)
    stages = sorted(plain.stages)
    per_stage = {s: _tiny.stage_layers(net, s) for s in stages}
    layers = [layer for s in stages for layer in per_stage[s]]
    specs, start = [], 0
    for s in stages:
        n = len(per_stage[s])
        if n:
            specs.append(f"{start}-{start + n - 1}=full" if n > 1 else f"{start}=full")
        start += n
    plan = RecomputePlan.parse(",".join(specs), len(layers), overlap=True, comms=0)
    # which stage each pair/single of the plan sits in
    stage_of_layer = [s for s in stages for _ in per_stage[s]]
    groups_per_stage: dict[int, int] = {}
    for g in plan.groups:
        owner = {stage_of_layer[i] for i in g.layers}
        assert len(owner) == 1, f"pair {g.layers} crosses stages {owner}"
        s = owner.pop()
        groups_per_stage[s] = groups_per_stage.get(s, 0) + 1

    with apply_plan(layers, plan, trace=True) as applied:
        runtime = _tiny.pipeline_runtime(group, net)
        loss = runtime.step(inputs, labels).loss
        grads = runtime.grads()
        recomputes = sum(1 for e in applied.events if e.op == "recompute")
    paired = [g.layers for g in plan.groups if g.paired]
    return dict(
        plain_loss=plain_loss,
        plain=plain_grads,
        loss=loss,
        grads=grads,
        recomputes=recomputes,
        expected=_expected_recomputes(runtime, groups_per_stage),
        plan=plan.spec,
        paired=paired,
        recompute_s=applied.recompute_s,
    )


def test_paired_recompute_inside_zero_bubble_v(run_ranks):
    net = _tiny.model()
    loss, reference = _tiny.reference_step(net, *_tiny.data(net.config.vocab_size))

    results = run_ranks(_rank, nprocs=2, timeout=500, env={"OMP_NUM_THREADS": "1"})

    assert any(r["paired"] for r in results), [r["plan"] for r in results]  # a real pair ran somewhere
    seen = set()
    for rank, r in enumerate(results):
        assert r["recomputes"] == r["expected"] > 0, (rank, r["plan"], r["recomputes"], r["expected"])
        assert r["recompute_s"] > 0
        assert_close(r["loss"], r["plain_loss"], RECOMPUTE_RTOL, f"rank {rank} loss vs no recompute")
        assert_close(r["loss"], loss, _tiny.RTOL, f"rank {rank} loss vs single process")
        assert r["grads"].keys() == r["plain"].keys()
        for name, g in r["grads"].items():
            assert_close(g, r["plain"][name], RECOMPUTE_RTOL, f"rank {rank} grad {name} vs no recompute")
            assert_close(g, reference[name], _tiny.RTOL, f"rank {rank} grad {name} vs single process")
            seen.add(name)
    assert seen == set(reference)
