"""ms-rlhf x ms-reshard: GRPO steps on 2 gloo ranks with ZeRO-sharded master weights (each rank
updates half of every matrix that splits along dim 0); after each optimizer step ms-reshard moves
the masters into the replicated training model and the rollout model. The rollout engine's
weights then equal the masters gathered with numpy, bit for bit, on both ranks."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mindspore")
pytest.importorskip("torch")
pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch, pytest.mark.timeout(600)]

# the shipped defaults otherwise (8 prompts x 8 samples): with fewer, every group of an untrained
# policy can score alike, which leaves zero advantages and weights that do not move
CONFIG = {"jit": True, "seed": 0, "steps": 2, "parallel": {"optimizer_shard": True}}


def _rank(group, config: dict) -> dict:
    import mindspore as ms

    from ms_rlhf import GRPOTrainer, TrainConfig

    ms.set_device("CPU")
    trainer = GRPOTrainer(TrainConfig.from_dict(config), group)
    initial = {n: p.asnumpy().copy() for n, p in trainer.engine.weight_targets().items()}
    for _ in range(config["steps"]):
        trainer.step()
    return dict(
        masters={n: p.asnumpy().copy() for n, p in trainer.master.items()},
        slices={n: trainer.sync.master_slice(n) for n in trainer.master},
        rollout={n: p.asnumpy().copy() for n, p in trainer.engine.weight_targets().items()},
        initial=initial,
        received=trainer.sync.received_bytes,
        losses=[h["loss"] for h in trainer.history],
    )


def test_rollout_weights_equal_gathered_sharded_masters(run_ranks):
    results = run_ranks(_rank, nprocs=2, timeout=500, args=(CONFIG,), env={"OMP_NUM_THREADS": "1"})

    # numpy gather: every element of every master from the rank that holds it
    shapes = {n: v.shape for n, v in results[0]["rollout"].items()}
    full = {n: np.full(s, np.nan, np.float32) for n, s in shapes.items()}
    split = set()
    for r in results:
        assert r["masters"].keys() == shapes.keys()
        for name, shard in r["masters"].items():
            box = r["slices"][name]
            if shard.shape != shapes[name]:
                split.add(name)
                assert np.isnan(full[name][box]).all(), f"{name}: two ranks hold the same rows"
            elif not np.isnan(full[name]).all():  # replicated: both ranks updated it identically
                np.testing.assert_array_equal(full[name], shard, err_msg=name)
            full[name][box] = shard
    # ZeRO split every parameter whose dim 0 divides by the 2 ranks, and only those
    assert split == {n for n, s in shapes.items() if s and s[0] % 2 == 0} and split
    assert all(not np.isnan(v).any() for v in full.values())  # the shards cover every element

    for rank, r in enumerate(results):
        assert r["received"] > 0  # the sync moved the other rank's halves over gloo
        assert r["losses"] == results[0]["losses"]  # DP ranks step the same model
        changed = [n for n in full if not np.array_equal(r["initial"][n], full[n])]
        assert len(changed) >= len(full) // 2, "the GRPO steps moved the weights"
        for name, value in r["rollout"].items():
            np.testing.assert_array_equal(value, full[name], err_msg=f"rank {rank} {name}")
