"""The acceptance test: ms-models (MindSpore) against Hugging Face transformers (PyTorch) with the
same weights, dumped by both dumpers, compared with the shipped mapping. Every aligned module
passes; a bug injected into layer 1 of the MindSpore side is named as the first divergence, in
statistics and tensor mode. The HTML report is rendered in headless Chromium."""

import json
import os
import types

import numpy as np
import pytest
from conftest import screenshot

from ms_probe import PrecisionDebugger, compare_dirs, load_mapping, write_results
from ms_probe.cli import main

pytestmark = [pytest.mark.needs_torch, pytest.mark.needs_mindspore]

IDS = np.random.default_rng(0).integers(4, 300, (2, 12)).astype(np.int32)


def dump_hf(path, model_dir, task):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype="float32")
    dbg = PrecisionDebugger(dump_path=str(path), task=task)
    with dbg.dump_step(model):
        model(torch.from_numpy(IDS).long(), use_cache=False).logits.mean().backward()
    dbg.close()
    return str(path)


def dump_ms(path, model_dir, task, bug=None):
    import mindspore as ms

    from ms_models import from_pretrained

    model = from_pretrained(model_dir)
    layer = model.model.layers[1]
    if bug == "scale":  # the MLP output scaled by 1.5
        construct = type(layer.mlp).construct
        layer.mlp.construct = types.MethodType(lambda self, x: construct(self, x) * 1.5, layer.mlp)
    elif bug == "epsilon":  # RMSNorm epsilon 1e-3 instead of 1e-6
        layer.post_attention_layernorm.eps = 1e-3
    elif bug == "transpose":  # q_proj weight transposed (square, so the shapes still fit)
        w = layer.self_attn.q_proj.weight
        w.set_data(ms.Tensor(np.ascontiguousarray(w.asnumpy().T)))
    grad_fn = ms.value_and_grad(lambda ids: model(ids).mean(), None, model.trainable_params())
    dbg = PrecisionDebugger(dump_path=str(path), task=task)
    with dbg.dump_step(model):
        grad_fn(ms.Tensor(IDS))
    dbg.close()
    return str(path)


@pytest.fixture(scope="module")
def golden(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {task: dump_hf(root / task, tiny_llama, task) for task in ("statistics", "tensor")}


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_same_weights_every_module_passes(task, tiny_llama, golden, tmp_path):
    target = dump_ms(tmp_path / "ms", tiny_llama, task)
    rc = compare_dirs(target, golden[task], load_mapping("ms-models-hf")).ranks[0]
    assert rc.mode == task and rc.first_divergence is None and not rc.problems
    results = {m.name: m.result for m in rc.modules}
    assert [n for n, r in results.items() if r == "skipped"] == ["Cell.model.rotary_emb.RotaryEmbedding.forward.0"]
    passed = [n for n, r in results.items() if r == "pass"]
    assert len(passed) == len(results) - 1 and len(passed) > 70  # forward, backward and parameter gradients
    # HF's LlamaModel returns a ModelOutput, for which torch runs no backward hook: its gradient
    # w.r.t. the output comes from a tensor hook instead, and still meets MindSpore's.
    assert results["Cell.model.DecoderModel.backward.0"] == "pass"
    # Golden-only items are exactly the ones the mapping explains.
    assert all(reason.startswith("HF") for _, reason in rc.golden_only)
    matched = [r for r in rc.rows if r.golden and r.target]
    assert len(matched) > 140 and all(r.result == "pass" for r in matched)


@pytest.mark.parametrize("task", ["statistics", "tensor"])
@pytest.mark.parametrize(
    ("bug", "culprit"),
    [
        ("scale", "Cell.model.layers.1.mlp.MLP.forward.0"),
        ("epsilon", "Cell.model.layers.1.post_attention_layernorm.RMSNorm.forward.0"),
        ("transpose", "Cell.model.layers.1.self_attn.q_proj.Linear.forward.0"),
    ],
)
def test_injected_bug_is_the_first_divergence(task, bug, culprit, tiny_llama, golden, tmp_path):
    target = dump_ms(tmp_path / "ms", tiny_llama, task, bug)
    rc = compare_dirs(target, golden[task], load_mapping("ms-models-hf")).ranks[0]
    assert rc.first_divergence == culprit, rc.first_divergence_reason
    # Everything that ran before the culprit still passes.
    culprit_order = next(m.order for m in rc.modules if m.name == culprit)
    before = [m for m in rc.modules if m.order < culprit_order and m.golden]
    assert before and all(m.result == "pass" for m in before)


def test_cli_json_and_report_screenshot(tiny_llama, golden, tmp_path, capsys):
    target = dump_ms(tmp_path / "ms", tiny_llama, "statistics", "scale")
    out = tmp_path / "out"
    argv = ["compare", "--target", target, "--golden", golden["statistics"], "--out", str(out)]
    assert main([*argv, "--mapping", "ms-models-hf", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["first_divergence"] == "Cell.model.layers.1.mlp.MLP.forward.0"
    assert summary["aligned_items"] > 70 and summary["alignment"] == {"mapping": "ms-models-hf"}
    # Without a mapping, the paths still align by identity (ms-models uses HF names).
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["alignment"]["identity_coverage"] > 0.9
    run = compare_dirs(target, golden["statistics"], load_mapping("ms-models-hf"))
    files = write_results(run, out)
    png = tmp_path / "report.png"
    screenshot(files["report.html"], png)
    assert png.stat().st_size > 20_000
    if os.environ.get("MS_PROBE_SCREENSHOT"):
        import shutil

        shutil.copy(png, os.environ["MS_PROBE_SCREENSHOT"])


def dump_ds(path, model_dir, bug):
    import mindspore as ms

    from ms_models import from_pretrained

    model = from_pretrained(model_dir)
    if bug:  # the output of layer 2's shared expert scaled by 1.1
        shared = model.model.layers[2].mlp.shared_experts.down_proj
        construct = type(shared).construct
        shared.construct = types.MethodType(lambda self, x: construct(self, x) * 1.1, shared)
    grad_fn = ms.value_and_grad(lambda ids: model(ids).mean(), None, model.trainable_params())
    dbg = PrecisionDebugger(dump_path=str(path))
    with dbg.dump_step(model):
        grad_fn(ms.Tensor(IDS))


def test_deepseek_v3_mla_and_moe(tmp_path):
    """DeepSeek-V3 (MLA, MoE, MTP): the mapping's skips are exactly what differs; a bug in a shared
    expert of layer 2 is found."""
    import torch
    import transformers

    from ms_models import make_tiny

    model_dir = make_tiny("deepseek_v3", tmp_path / "ds", seed=5)
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype="float32")
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "hf"))
    with dbg.dump_step(hf):
        hf(torch.from_numpy(IDS).long(), use_cache=False).logits.mean().backward()
    mapping = load_mapping("ms-models-hf")
    for bug in (None, "shared"):
        dump_ds(tmp_path / f"ms_{bug}", model_dir, bug)
        rc = compare_dirs(str(tmp_path / f"ms_{bug}"), str(tmp_path / "hf"), mapping).ranks[0]
        if bug is None:
            assert rc.first_divergence is None and not rc.problems
            assert {m.result for m in rc.modules} == {"pass", "skipped"}
            # MLA's kv_b_proj gradients differ only by HF's size-1 head axis: compared flat.
            assert any("hold the same data" in r.message for r in rc.rows)
        else:
            assert rc.first_divergence == "Cell.model.layers.2.mlp.shared_experts.down_proj.Linear.forward.0"
