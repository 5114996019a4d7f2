"""W8A8 static and W4A16: the packed format round-trips, the MindSpore layers compute the quantized
math exactly, `ms-vllm quantize` writes a directory that vLLM loads via `quantization=`."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.needs_mindspore

IDS = [0, 5, 9, 33, 77, 100, 21, 40, 41]
ONE_PROMPT_BUCKETS = {"decode_sizes": [1], "prefill_sizes": [16], "context_sizes": [96], "batch_tokens": 0}


def test_int4_pack_round_trip_and_group_scales():
    from ms_vllm.quant import pack_int4, quantize_w4, unpack_int4

    q = np.random.default_rng(0).integers(-8, 8, (5, 32)).astype(np.int8)
    packed = pack_int4(q)
    assert packed.dtype == np.int32 and packed.shape == (5, 4)
    assert np.array_equal(unpack_int4(packed), q)
    w = np.random.default_rng(1).normal(size=(4, 64)).astype(np.float32)
    q, s = quantize_w4(w, 32)
    assert s.shape == (4, 2) and q.min() >= -8 and q.max() <= 7
    err = np.abs(q.reshape(4, 2, 32) * s[..., None] - w.reshape(4, 2, 32)).max(-1)
    assert np.all(err <= s / 2 + 1e-6)  # round to nearest within each group


def test_w8a8_layer_is_exact_integer_math():
    import mindspore as ms

    from ms_vllm.quant import W8A8Linear, quantize_w8

    ms.set_device("CPU")
    rng = np.random.default_rng(2)
    w, x = rng.normal(size=(6, 64)).astype(np.float32), rng.normal(size=(3, 64)).astype(np.float32) * 4
    q, s = quantize_w8(w)
    x_scale = float(np.abs(x).max() / 127)
    out = W8A8Linear(q, s, x_scale)(ms.Tensor(x)).asnumpy()
    xq = np.clip(np.round(x / x_scale), -128, 127).astype(np.int64)
    expect = (xq @ q.astype(np.int64).T) * (s * x_scale)  # int64 accumulation, no wrap-around
    assert np.allclose(out, expect, rtol=1e-6)
    assert np.abs(out - x @ w.T).max() / np.abs(x @ w.T).max() < 0.02


def test_quantize_cli_and_w4a16_equals_dequantized_float(tiny_dirs, tmp_path):
    import mindspore as ms

    from ms_models import from_pretrained
    from ms_vllm.cli import main
    from ms_vllm.quant import load_quantized, quantizable, weight_bytes

    ms.set_device("CPU")
    src, dst = tiny_dirs["llama"], tmp_path / "w4"
    assert main(["quantize", str(src), str(dst), "--method", "ms_w4a16", "--group-size", "16"]) == 0
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "ms_w4a16", "group_size": 16}
    quant = load_quantized(str(dst), "ms_w4a16")
    # Reference: the float model with each weight replaced by its dequantized int4 value.
    ref = from_pretrained(src)
    cells = dict(quant.cells_and_names())
    for name, cell in quantizable(ref).items():
        q = cells[name]
        deq = (q.q.asnumpy().astype(np.float32) * q.scale.asnumpy()).reshape(q.out_f, q.in_f)
        cell.weight.set_data(ms.Tensor(deq))
    ids = ms.Tensor(np.array([IDS], np.int32))
    a, b = quant(ids).asnumpy(), ref(ids).asnumpy()
    assert np.abs(a - b).max() / np.abs(b).max() < 1e-5
    assert weight_bytes(quant) < 0.5 * weight_bytes(from_pretrained(src))


def test_quantize_refuses_bad_input_and_keeps_existing_output(tiny_dirs, tmp_path):
    from ms_vllm.quant import QuantError, quantize_checkpoint

    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    with pytest.raises(QuantError, match="method"):
        quantize_checkpoint(str(tiny_dirs["llama"]), str(dst), "int3", [[0, 1]])
    with pytest.raises(QuantError, match="calibration"):
        quantize_checkpoint(str(tiny_dirs["llama"]), str(dst), "ms_w8a8", [])
    assert (dst / "keep.txt").read_text() == "x"


@pytest.mark.needs_torch
@pytest.mark.parametrize(
    "arch, method, eager",
    [("llama", "ms_w8a8", True), ("deepseek_v3", "ms_w8a8", False), ("deepseek_v3", "ms_w4a16", False)],
)
def test_vllm_serves_quantized_checkpoint(tiny_dirs, tmp_path, arch, method, eager):
    """quantization=METHOD through vllm.LLM (DeepSeek-V3: quantized routed experts and kv_b_proj,
    compiled steps): greedy tokens equal the quantized model's own reference generation, and stay
    close to the float logits."""
    import mindspore as ms
    from conftest import close_llm, make_llm, token_prompts
    from vllm import SamplingParams

    from ms_models import from_pretrained, generate_greedy_recompute
    from ms_vllm.quant import load_quantized, quantize_checkpoint

    ms.set_device("CPU")
    dst = str(tmp_path / method)
    quantize_checkpoint(str(tiny_dirs[arch]), dst, method, [IDS, IDS[:5]], group_size=16)
    quant = load_quantized(dst, method)
    expect = generate_greedy_recompute(quant, IDS, 5)
    ids = ms.Tensor(np.array([IDS], np.int32))
    ref = from_pretrained(tiny_dirs[arch])(ids).asnumpy()
    if arch == "llama":  # (the random tiny DeepSeek-V3 amplifies quantization error: see the test below)
        assert np.abs(quant(ids).asnumpy() - ref).max() / np.abs(ref).max() < 0.15
    # compiled on the two buckets this prompt uses (the default set compiles ~10 graphs)
    compiled = {} if eager else {"additional_config": {"compile": ONE_PROMPT_BUCKETS}}
    llm = make_llm(dst, quantization=method, enable_prefix_caching=True, enforce_eager=eager, **compiled)
    try:
        out = llm.generate(token_prompts([IDS]), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    finally:
        close_llm(llm)
    assert list(out[0].outputs[0].token_ids) == expect


def test_deepseek_with_mtp_quantizes_and_loads(tiny_dirs, tmp_path):
    """DeepSeek-V3's MTP module is stored as layer L + k: its layers quantize under those names."""
    import mindspore as ms

    import ms_models
    from ms_vllm.quant import load_quantized, quantize_checkpoint

    ids = ms.Tensor(np.asarray([[0, 17, 23, 99, 5, 61]], np.int32))
    want = ms_models.from_pretrained(tiny_dirs["deepseek_v3"])(ids).asnumpy()
    for method in ("ms_w8a8", "ms_w4a16"):
        dst = str(tmp_path / method)
        summary = quantize_checkpoint(tiny_dirs["deepseek_v3"], dst, method, [[0, 5, 9, 33, 77]], group_size=16)
        model = load_quantized(dst, method)
        assert any(n.startswith("model.mtp_layers.") for n, c in model.cells_and_names() if "W" in type(c).__name__)
        got = model(ids).asnumpy()
        assert summary["quantized_bytes"] < summary["float_bytes"]
        cosine = float((got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want))
        # the random tiny model amplifies 4-bit error (its trained twin: +1.8 % perplexity, bench_vllm)
        assert cosine > (0.95 if method == "ms_w8a8" else 0.7), (method, cosine)


def _dequantized_reference(float_dir, quant_dir, method, group=32):
    """The float model with every quantized weight replaced by its dequantized value, read from the
    quantized checkpoint (an independent numpy decode: unpack, scale)."""
    from safetensors.numpy import load_file

    import ms_models
    from ms_vllm.quant import unpack_int4

    raw = load_file(str(quant_dir / "model.safetensors"))
    tensors = ms_models.hf_state_dict(ms_models.from_pretrained(float_dir))
    for key in list(tensors):
        name = key[: -len(".weight")]
        if method == "ms_w8a8" and f"{name}.input_scale" in raw:
            tensors[key] = raw[key].astype(np.float32) * raw[f"{name}.weight_scale"][:, None]
        elif f"{name}.weight_packed" in raw:
            q = unpack_int4(raw[f"{name}.weight_packed"]).astype(np.float32)
            s = np.repeat(raw[f"{name}.weight_scale"], group, axis=1)
            tensors[key] = q * s
    model = ms_models.from_pretrained(float_dir)
    ms_models.load_state_dict(model, tensors)
    return model, raw


def test_deepseek_routed_experts_and_kv_b_proj_are_quantized(tiny_dirs, tmp_path):
    """Routed experts (stored per expert, stacked at load) and MLA's kv_b_proj are in the quantized
    checkpoint; W4A16 equals the float model on the dequantized weights, W8A8's experts compute the
    int8 x int8 math with per-expert activation scales (checked against numpy)."""
    import mindspore as ms

    import ms_models
    from ms_vllm.quant import load_quantized, quantize_checkpoint, weight_bytes
    from ms_vllm.quant_experts import W4A16Experts, W8A8Experts

    ms.set_device("CPU")
    src = tiny_dirs["deepseek_v3"]
    ids = ms.Tensor(np.asarray([[0, 17, 23, 99, 5, 61, 8]], np.int32))
    dst = tmp_path / "w4"
    summary = quantize_checkpoint(src, str(dst), "ms_w4a16", [], group_size=16)  # experts: in 16
    config = ms_models.load_config(src)
    layers = config.num_hidden_layers + config.num_nextn_predict_layers
    moe_layers = sum(1 for i in range(layers) if i >= config.first_k_dense_replace)
    assert summary["expert_layers"] == 3 * config.n_routed_experts * moe_layers
    model = load_quantized(str(dst), "ms_w4a16")
    ref, raw = _dequantized_reference(src, dst, "ms_w4a16", group=16)
    assert "model.layers.0.self_attn.kv_b_proj.weight_packed" in raw
    assert any(isinstance(c, W4A16Experts) for _, c in model.cells_and_names())
    a, b = model(ids).asnumpy(), ref(ids).asnumpy()
    assert np.abs(a - b).max() / np.abs(b).max() < 1e-5
    assert weight_bytes(model) < 0.4 * weight_bytes(ms_models.from_pretrained(src))

    dst = tmp_path / "w8"
    quantize_checkpoint(src, str(dst), "ms_w8a8", [[0, 5, 9, 33, 77, 3, 4]])
    model = load_quantized(str(dst), "ms_w8a8")
    moe_name, experts = next((n, c) for n, c in model.cells_and_names() if isinstance(c, W8A8Experts))
    prefix = moe_name.replace("model.mtp_layers.0", f"model.layers.{config.num_hidden_layers}")
    raw = __import__("safetensors.numpy", fromlist=["load_file"]).load_file(str(dst / "model.safetensors"))
    x = np.random.default_rng(3).normal(size=(5, config.hidden_size)).astype(np.float32)
    combine = np.random.default_rng(4).random((5, config.n_routed_experts)).astype(np.float32)
    got = experts.mix(ms.Tensor(x), ms.Tensor(combine)).asnumpy()
    want = np.zeros_like(x, np.float64)
    for e in range(config.n_routed_experts):

        def layer(v, proj, e=e):
            name = f"{prefix}.{e}.{proj}"
            in_scale = raw[f"{name}.input_scale"][0]
            if proj != "down_proj":  # gate and up share one scale: the larger of the two
                in_scale = max(raw[f"{prefix}.{e}.{p}.input_scale"][0] for p in ("gate_proj", "up_proj"))
            vq = np.clip(np.round(v / in_scale), -128, 127).astype(np.int64)
            return (vq @ raw[f"{name}.weight"].astype(np.int64).T) * (raw[f"{name}.weight_scale"] * in_scale)

        gate = layer(x, "gate_proj")
        h = gate / (1 + np.exp(-gate)) * layer(x, "up_proj")
        want += combine[:, e : e + 1] * layer(h.astype(np.float32), "down_proj")
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
