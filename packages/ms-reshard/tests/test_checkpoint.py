"""Sharded safetensors checkpoints: save, reshard through the CLI, checksums, atomic writes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_llama import expected_shard, llama_shapes, random_weights

from ms_layout import ParallelConfig
from ms_reshard import DEFAULT_FUSIONS, ReshardError, param_specs
from ms_reshard.checkpoint import load_checkpoint, save_checkpoint
from ms_reshard.cli import main

TRAIN = ParallelConfig(dp=2, tp=2, optimizer_shard=True)


def _save(path, layers=2):
    shapes = llama_shapes(layers)
    weights = random_weights(shapes)
    specs = param_specs(shapes, TRAIN, num_layers=layers)
    shards = {n: {r: weights[n][s.layout.global_slice(s.shape, r)] for r in s.layout.ranks} for n, s in specs.items()}
    save_checkpoint(path, specs, shards, config=TRAIN, model={"num_layers": layers})
    return weights


def test_save_and_load_round_trip(tmp_path):
    weights = _save(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["format"] == "ms-reshard-checkpoint" and len(manifest["files"]) == 4
    specs, shards = load_checkpoint(tmp_path / "ckpt")
    for name, spec in specs.items():
        for rank in spec.layout.ranks:
            np.testing.assert_array_equal(shards[name][rank], weights[name][spec.layout.global_slice(spec.shape, rank)])


def test_cli_reshards_to_fused_tp4(tmp_path, capsys):
    weights = _save(tmp_path / "train")
    args = ["checkpoint", str(tmp_path / "train"), str(tmp_path / "infer"), "--dst-config", "tp=4", "--fuse"]
    assert main([*args, "--src-config", "dp=2,tp=2,opt", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["files"] == 4 and summary["bytes_moved_between_ranks"] == summary["lower_bound"]
    specs, shards = load_checkpoint(tmp_path / "infer")
    assert "model.layers.1.self_attn.qkv_proj.weight" in specs
    for name, spec in specs.items():
        for rank in spec.layout.ranks:
            np.testing.assert_array_equal(
                shards[name][rank], expected_shard(name, spec, weights, DEFAULT_FUSIONS, rank)
            )
    # and back: fused tp=4 to pp=2 x tp=2 with the fused names kept
    assert (
        main(["checkpoint", str(tmp_path / "infer"), str(tmp_path / "pp"), "--dst-config", "tp=2,pp=2", "--json"]) == 0
    )
    specs, shards = load_checkpoint(tmp_path / "pp")
    assert specs["model.layers.1.mlp.gate_up_proj.weight"].layout.ranks == (2, 3)
    for name, spec in specs.items():
        for rank in spec.layout.ranks:
            np.testing.assert_array_equal(
                shards[name][rank], expected_shard(name, spec, weights, DEFAULT_FUSIONS, rank)
            )


def test_corrupted_shard_is_an_error_and_leaves_dst_untouched(tmp_path, capsys):
    _save(tmp_path / "train")
    dst = tmp_path / "infer"
    dst.mkdir()
    (dst / "keep.txt").write_text("old")
    victim = tmp_path / "train" / "rank_00002.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    args = ["checkpoint", str(tmp_path / "train"), str(dst), "--dst-config", "tp=4", "--overwrite", "--json"]
    assert main(args) == 2
    assert "rank_00002.safetensors is corrupted" in capsys.readouterr().err
    assert [p.name for p in dst.iterdir()] == ["keep.txt"] and (dst / "keep.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["infer", "train"]  # no temporary left behind


def test_existing_dst_needs_overwrite_and_wrong_src_config_is_named(tmp_path, capsys):
    _save(tmp_path / "train")
    (tmp_path / "infer").mkdir()
    assert main(["checkpoint", str(tmp_path / "train"), str(tmp_path / "infer"), "--dst-config", "tp=4"]) == 2
    assert "already exists" in capsys.readouterr().err
    args = ["checkpoint", str(tmp_path / "train"), str(tmp_path / "x"), "--dst-config", "tp=4", "--src-config", "tp=4"]
    assert main(args) == 2
    assert "--src-config" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_save_rejects_bad_shards(tmp_path):
    shapes = llama_shapes(1)
    specs = param_specs(shapes, ParallelConfig(tp=2), num_layers=1)
    with pytest.raises(ReshardError, match="no shards given"):
        save_checkpoint(tmp_path / "c", specs, {})
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "dst, multicast",
    [
        (ParallelConfig(dp=3, optimizer_shard=True), False),
        (ParallelConfig(tp=4), False),
        (ParallelConfig(), False),
        (ParallelConfig(dp=4), True),  # replicated target read through multicast rows
    ],
)
def test_read_rank_gives_each_target_rank_its_shards_from_the_source_files(tmp_path, dst, multicast):
    from ms_reshard import PlanCache, model_plan, read_rank

    weights = _save(tmp_path / "ckpt")
    specs, _ = load_checkpoint(tmp_path / "ckpt")
    target = param_specs(llama_shapes(2), dst, num_layers=2)
    plan = model_plan(specs, target, cache=PlanCache(multicast_min=0) if multicast else None)
    assert any(m.plan.multicast is not None for m in plan.moves) == multicast
    files = {r: tmp_path / "ckpt" / f"rank_{r:05d}.safetensors" for r in range(4)}
    ranks = sorted({r for s in target.values() for r in s.layout.ranks})
    for rank in ranks:
        got = read_rank(plan, rank, files)
        held = {n for n, s in target.items() if rank in s.layout.ranks}
        assert set(got) == held
        for name in held:
            spec = target[name]
            np.testing.assert_array_equal(got[name], weights[name][spec.layout.global_slice(spec.shape, rank)])


def test_read_rank_names_a_missing_source_file(tmp_path):
    from ms_reshard import model_plan, read_rank

    _save(tmp_path / "ckpt")
    specs, _ = load_checkpoint(tmp_path / "ckpt")
    plan = model_plan(specs, param_specs(llama_shapes(2), ParallelConfig(), num_layers=2))
    files = {r: tmp_path / "ckpt" / f"rank_{r:05d}.safetensors" for r in range(3)}  # rank 3's left out
    with pytest.raises(ReshardError, match="rank 3, which has no file"):
        read_rank(plan, 0, files)
