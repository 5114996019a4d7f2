"""Multi-LoRA from PEFT-format directories: one batch mixing two adapters and the base model gives
the tokens of each adapter merged into the weights (W + alpha / r * B A)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import close_llm, make_llm, token_prompts

pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch]

TARGETS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
PROMPT = [0, 60, 61, 62, 63, 64]


def write_adapter(directory, model, seed, rank=4, alpha=8.0, targets=TARGETS):
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) for `model`."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    shapes = {n: tuple(p.shape) for n, p in model.parameters_and_names()}
    tensors = {}
    for layer in range(model.config.num_hidden_layers):
        for target in targets:
            module = f"model.layers.{layer}.{target}"
            out_f, in_f = shapes[module + ".weight"]
            tensors[f"base_model.model.{module}.lora_A.weight"] = rng.normal(0, 0.3, (rank, in_f)).astype(np.float32)
            tensors[f"base_model.model.{module}.lora_B.weight"] = rng.normal(0, 0.3, (out_f, rank)).astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    modules = [t.split(".")[-1] for t in targets]
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": modules}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return tensors, alpha / rank


def merged_reference(path, tensors, scale, n, prompt=PROMPT):
    """Greedy tokens of the model with the adapter merged into its weights."""
    import mindspore as ms

    from ms_models import from_pretrained, generate_greedy_recompute

    model = from_pretrained(path)
    params = dict(model.parameters_and_names())
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = tensors[key.replace("lora_A", "lora_B")]
        weight = params[module + ".weight"]
        weight.set_data(ms.Tensor(weight.asnumpy() + scale * b @ a))
    return generate_greedy_recompute(model, prompt, n)


# compiled on two decode sizes and one prefill size (3 graphs), or eager
COMPILED = {
    "enforce_eager": False,
    "additional_config": {
        "compile": {"decode_sizes": [1, 4], "prefill_sizes": [16], "context_sizes": [96], "batch_tokens": 0}
    },
}


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_mixed_adapters_equal_merged_weights(mode, tiny_dirs, reference, tmp_path):
    import mindspore as ms
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from ms_models import from_pretrained

    ms.set_device("CPU")
    path = tiny_dirs["llama"]
    base = from_pretrained(path)
    t1, s1 = write_adapter(tmp_path / "a1", base, seed=1)
    t2, s2 = write_adapter(tmp_path / "a2", base, seed=2, rank=2, alpha=4.0)
    expect = [merged_reference(path, t1, s1, 5), merged_reference(path, t2, s2, 5), reference("llama", PROMPT, 5)]
    assert expect[0] != expect[2] and expect[1] != expect[2]  # the adapters do change the tokens

    llm = make_llm(path, enable_lora=True, max_loras=2, max_lora_rank=8, **(COMPILED if mode == "compiled" else {}))
    try:
        requests = [LoRARequest("a1", 1, str(tmp_path / "a1")), LoRARequest("a2", 2, str(tmp_path / "a2")), None]
        outs = llm.generate(
            token_prompts([PROMPT] * 3),
            SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
            lora_request=requests,
            use_tqdm=False,
        )
        stats = llm.collective_rpc("ms_vllm_stats")[0]
    finally:
        close_llm(llm)
    assert [list(o.outputs[0].token_ids) for o in outs] == expect
    if mode == "compiled":  # every step of the mixed batch ran a compiled graph
        assert stats["eager_calls"] == 0 and stats["compiled_calls"] > 0 and len(stats["compile_s"]) == 3


def test_bad_adapter_is_refused(tmp_path, tiny_dirs):
    import mindspore as ms

    from ms_models import from_pretrained
    from ms_vllm.lora import LoRAError, LoRAManager

    ms.set_device("CPU")
    model = from_pretrained(tiny_dirs["llama"])
    write_adapter(tmp_path / "big", model, seed=3, rank=4)
    manager = LoRAManager(model, max_loras=1, max_rank=2)  # wraps (and renames) the adaptable layers

    class Req:
        lora_int_id, lora_name, lora_path = 1, "big", str(tmp_path / "big")

    with pytest.raises(LoRAError, match="max_lora_rank=2"):
        manager.add(Req)
    Req.lora_path = str(tmp_path / "missing")
    with pytest.raises(LoRAError, match="not a PEFT adapter directory"):
        manager.add(Req)
    assert manager.list() == set()


def test_slots_are_reused_least_recently_used_first_and_bad_adapters_are_refused(tmp_path, tiny_dirs):
    """More adapters than slots over time: a batch loads what it uses, evicting the least recently
    used adapter it does not use; a batch needing more than max_loras adapters, an adapter never
    added and an adapter targeting a layer LoRA does not adapt are refused, naming them."""
    import mindspore as ms
    from safetensors.numpy import load_file, save_file

    from ms_models import from_pretrained
    from ms_vllm.lora import LoRAError, LoRAManager

    ms.set_device("CPU")
    model = from_pretrained(tiny_dirs["llama"])
    tensors = {name: write_adapter(tmp_path / name, model, seed=4 + i, rank=2, alpha=2.0)[0] for i, name in
               enumerate("abc")}  # fmt: skip
    head = tmp_path / "head"  # the adapter "b" plus the LM head, which LoRA does not adapt
    head.mkdir()
    (head / "adapter_config.json").write_text((tmp_path / "b" / "adapter_config.json").read_text())
    bad = load_file(str(tmp_path / "b" / "adapter_model.safetensors"))
    bad["base_model.model.lm_head.lora_A.weight"] = np.zeros((2, 64), np.float32)
    bad["base_model.model.lm_head.lora_B.weight"] = np.zeros((320, 2), np.float32)
    save_file(bad, str(head / "adapter_model.safetensors"))
    manager = LoRAManager(model, max_loras=2, max_rank=4)

    def req(lora_id, name):
        return type("Req", (), {"lora_int_id": lora_id, "lora_name": name, "lora_path": str(tmp_path / name)})

    def slot_a(lora_id):  # q_proj's A rows of the adapter's slot in layer 0
        slot = manager.adapters[lora_id].slot
        return manager.wrapped["model.layers.0.self_attn.q_proj"].lora_a.asnumpy()[4 * slot : 4 * slot + 4]

    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    for i, name in enumerate("abc"):
        assert manager.add(req(i + 1, name))
    assert manager.list() == {1, 2, 3} and not manager.adapters  # registered; no slot until a batch uses one
    manager.set_batch(np.array([1, 1, 0, 2]))
    np.testing.assert_array_equal(slot_a(1)[:2], tensors["a"][q_a])
    assert not slot_a(1)[2:].any()  # rank 2 of 4: the slot's other rows stay zero
    manager.set_batch(np.array([2, 0]))  # a is now the least recently used
    manager.set_batch(np.array([3, 2]))  # c takes a's slot
    assert set(manager.adapters) == {2, 3}
    np.testing.assert_array_equal(slot_a(3)[:2], tensors["c"][q_a])
    untouched = manager.wrapped["model.layers.0.self_attn.k_proj"]  # targeted by no adapter
    assert not untouched.lora_a.asnumpy().any() and not untouched.lora_b.asnumpy().any()
    with pytest.raises(LoRAError, match=r"uses 3 adapters \[1, 2, 3\]; max_loras=2"):
        manager.set_batch(np.array([1, 2, 3]))
    with pytest.raises(LoRAError, match=r"adapters \[9\] were never added"):
        manager.set_batch(np.array([9]))
    banks = [w.lora_a.asnumpy().copy() for w in manager.wrapped.values()]
    with pytest.raises(LoRAError, match="'lm_head'"):
        manager.add(req(4, "head"))
    assert manager.list() == {1, 2, 3}  # refused, registered nothing
    assert all(np.array_equal(w.lora_a.asnumpy(), b) for w, b in zip(manager.wrapped.values(), banks))
    assert manager.remove(3) and 3 not in manager.adapters and manager.list() == {1, 2}
    with pytest.raises(LoRAError, match="exceeds the LoRA token capacity"):
        manager.set_batch(np.zeros(manager.max_tokens + 1, np.int64))
