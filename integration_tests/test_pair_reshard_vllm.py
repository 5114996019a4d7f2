"""ms-reshard x ms-vllm: a tiny DeepSeek-V3 checkpoint is cut into training shards (pp=2, tp=2,
4 ranks, the checkpoint's own tensor names: one matrix per expert, MTP copies included) and written
as an ms-reshard checkpoint; ms-reshard reshards it offline to one full copy, which becomes an HF
directory (the original's config and tokenizer). vllm.LLM with the ms-vllm plugin serves that
directory in a subprocess; its greedy tokens equal ms-models' reference generation (a full forward
per token, no cache) from the original weights."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import SCRIPTS

from ms_layout import Layout, ParallelConfig

pytest.importorskip("mindspore")
pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vllm is not installed (pip install --no-deps vllm==0.33.0)")
pytest.importorskip("ms_vllm", reason="ms-vllm is not installed")
pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch, pytest.mark.timeout(600)]

TRAIN = ParallelConfig(pp=2, tp=2)
LAYERS_PER_STAGE = [2, 1]  # the tiny DeepSeek-V3 has 3 decoder layers (its MTP module goes with the last)
PROMPTS = [[0, 17, 23, 99, 5, 61, 200, 31], [0, 12], [0, *range(40, 52)]]
N_NEW = 6


def _train_shards(original):
    """The checkpoint's tensors cut into TRAIN's shards with numpy: (specs, {name: {rank: shard}})."""
    import ms_models
    from ms_reshard import ParamSpec

    tensors = ms_models.read_safetensors(original)
    config = ms_models.load_config(original)
    layouts = ms_models.model_layouts(config, TRAIN, layers_per_chunk=LAYERS_PER_STAGE, checkpoint=True)
    assert layouts.keys() == tensors.keys()
    specs, shards = {}, {}
    for name, array in tensors.items():
        layout = layouts[name].layout
        specs[name] = ParamSpec(layout, array.shape, str(array.dtype))
        shards[name] = {r: array[layout.global_slice(array.shape, r)] for r in layout.ranks}
    return tensors, specs, shards


def test_resharded_checkpoint_served_by_vllm_equals_reference(tmp_path):
    import mindspore as ms

    import ms_models
    from ms_reshard import load_manifest, model_plan, reshard_checkpoint, save_checkpoint

    ms.set_device("CPU")
    original = ms_models.make_tiny("deepseek_v3", tmp_path / "original", seed=5)
    tensors, specs, shards = _train_shards(original)
    # every tensor on the 2 ranks of its stage, all 4 ranks used, and TP really cuts matrices
    assert {len(s) for s in shards.values()} == {2} and {r for s in shards.values() for r in s} == {0, 1, 2, 3}
    assert any(s.layout.shard_shape(s.shape) != s.shape for s in specs.values())
    save_checkpoint(tmp_path / "train", specs, shards, TRAIN)

    full = {n: type(s)(Layout((1,), ("dp",), ((),) * len(s.shape)), s.shape, s.dtype) for n, s in specs.items()}
    plan = model_plan(specs, full)
    reshard_checkpoint(tmp_path / "train", tmp_path / "full", plan, load_manifest(tmp_path / "train"), progress=False)

    served = tmp_path / "served"
    served.mkdir()
    for item in original_files(original):
        shutil.copy(item, served / item.name)
    (files,) = load_manifest(tmp_path / "full")["files"].values()
    shutil.copy(tmp_path / "full" / files["path"], served / "model.safetensors")
    served_tensors = ms_models.read_safetensors(served)
    assert served_tensors.keys() == tensors.keys()
    assert all(np.array_equal(served_tensors[n], tensors[n]) for n in tensors)

    (tmp_path / "prompts.json").write_text(json.dumps(PROMPTS))
    out = tmp_path / "tokens.json"
    cmd = [sys.executable, str(SCRIPTS / "pair_vllm_generate.py"), str(served), str(tmp_path / "prompts.json")]
    proc = subprocess.run([*cmd, str(N_NEW), str(out)], capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())

    reference = ms_models.from_pretrained(original)
    want = [ms_models.generate_greedy_recompute(reference, p, N_NEW) for p in PROMPTS]
    assert result["platform"] == "MindSporePlatform"
    assert result["tokens"] == want


def original_files(original):
    """config.json and the tokenizer files: everything but the weights and their manifest."""
    from pathlib import Path

    weights = (".safetensors", "manifest.json")
    return [p for p in Path(original).iterdir() if p.is_file() and not p.name.endswith(weights)]
