"""The start-up checks of vLLM's parallel settings (no vLLM engine), and, for every setting they
accept, what each rank then holds: every checkpoint tensor cut by its plan (ms_models.parallel's
shard_tensors over the ms-layout layouts) has the shape the rank's local model expects, and the
ranks' pieces put back together (concatenated in rank order, or the one rank holding an expert)
give the whole checkpoint back.

ShardPlan itself is ms_models.parallel's (tested there)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ms_vllm.parallel import ParallelError, check_vllm_parallel, plan_of

LLAMA = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=320)


def _vllm_config(hf=None, **parallel):
    p = dict(
        world_size=2,
        tensor_parallel_size=2,
        pipeline_parallel_size=1,
        data_parallel_size=1,
        prefill_context_parallel_size=1,
        decode_context_parallel_size=1,
        distributed_executor_backend="mp",
        enable_expert_parallel=False,
        data_parallel_rank=0,
    )
    p.update(parallel)
    features = {k: p.pop(k) for k in ("lora_config", "speculative_config") if k in p}
    model = SimpleNamespace(quantization=p.pop("quantization", None), hf_config=SimpleNamespace(**(hf or LLAMA)))
    return SimpleNamespace(
        parallel_config=SimpleNamespace(**p),
        model_config=model,
        lora_config=features.get("lora_config"),
        speculative_config=features.get("speculative_config"),
    )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(pipeline_parallel_size=2, world_size=4), "pipeline_parallel_size=2"),
        (dict(data_parallel_size=2), "data_parallel_size=2 with tensor_parallel_size=2"),
        (dict(distributed_executor_backend="ray"), "'ray'"),
    ],
)
def test_unsupported_settings_are_refused(settings, message):
    with pytest.raises(ParallelError, match=message):
        check_vllm_parallel(_vllm_config(**settings))


def _tiny(arch: str) -> dict:
    from ms_models import tiny_config

    return tiny_config(arch).to_dict()


TP2 = dict(world_size=2, tensor_parallel_size=2)
DP2 = dict(world_size=1, tensor_parallel_size=1, data_parallel_size=2, distributed_executor_backend="uni")
ACCEPTED = {
    "llama TP2": ("llama", TP2),
    "qwen2 TP2": ("qwen2", TP2),
    "deepseek_v3 TP2 (TP inside the experts)": ("deepseek_v3", TP2),
    "deepseek_v3 TP2 + EP2": ("deepseek_v3", dict(TP2, enable_expert_parallel=True)),
    "deepseek_v3 DP2 + EP2": ("deepseek_v3", dict(DP2, enable_expert_parallel=True)),
}


def _holdings(arch: str, settings: dict) -> None:
    """Each rank's shard against its local model's shapes, and all shards against the whole."""
    import re

    from ms_models import tiny_config
    from ms_models.layouts import checkpoint_shapes
    from ms_models.parallel import local_config, shard_tensors

    config = tiny_config(arch)
    rng = np.random.default_rng(0)
    whole = {n: rng.standard_normal(s).astype(np.float32) for n, s in checkpoint_shapes(config).items()}
    dp = settings.get("data_parallel_size", 1)
    ranks = settings["tensor_parallel_size"] * dp
    expert = re.compile(r"\.experts\.(\d+)\.")
    held: dict[str, list] = {n: [] for n in whole}
    for r in range(ranks):
        cfg = _vllm_config(_tiny(arch), **dict(settings, data_parallel_rank=r if dp > 1 else 0))
        group = SimpleNamespace(size=ranks, rank=r)
        plan = plan_of(cfg, group)
        items = ((n, v.shape, v.__getitem__) for n, v in whole.items())
        shard = shard_tensors(items, config, plan)
        want = checkpoint_shapes(local_config(config, plan))
        first = plan.expert_range(getattr(config, "n_routed_experts", 0) or 0)[0]
        assert sorted(shard) == sorted(want), f"rank {r}: names differ from its local model's"
        for name, value in shard.items():
            full = expert.sub(lambda m, first=first: f".experts.{int(m[1]) + first}.", name)
            if ".mlp.gate." in name:  # the router stays whole: it routes to every rank's experts
                assert value.shape == whole[full].shape, name
            elif ".shared_experts." in name and plan.expert_parallel and plan.tp > 1:
                # ParallelMoE's shared experts: a dense MLP split by tp (the local config keeps them whole)
                split = 0 if "down_proj" not in name else 1
                shape = list(whole[name].shape)
                shape[split] //= plan.tp
                assert value.shape == tuple(shape), f"rank {r}: {name} {value.shape}"
            else:
                assert value.shape == tuple(want[name]), f"rank {r}: {name} {value.shape} != {want[name]}"
            held[full].append(value)
    for name, pieces in held.items():
        total = whole[name]
        assert pieces, f"{name}: no rank holds it"
        if expert.search(name) and len(pieces) == 1:  # a whole expert on one EP rank
            np.testing.assert_array_equal(pieces[0], total, err_msg=name)
            continue
        assert len(pieces) == ranks, f"{name}: held by {len(pieces)} of {ranks} ranks"
        axes = [a for a in range(total.ndim) if pieces[0].shape[a] != total.shape[a]]
        if not axes:  # replicated
            for p in pieces:
                np.testing.assert_array_equal(p, total, err_msg=name)
        else:
            assert len(axes) == 1, f"{name}: split along {axes}"
            np.testing.assert_array_equal(np.concatenate(pieces, axes[0]), total, err_msg=name)


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_supported_settings_pass(case):
    """Accepted (nothing raises), and every rank's holdings check out against the whole checkpoint."""
    arch, settings = ACCEPTED[case]
    check_vllm_parallel(_vllm_config(_tiny(arch), **settings))
    _holdings(arch, settings)


def test_tp_features_are_accepted():
    """Under TP, LoRA, MTP and quantization start (test_tp.py runs each against one process)."""
    features = dict(lora_config=object(), speculative_config=object(), quantization="ms_w8a8")
    check_vllm_parallel(_vllm_config(_tiny("deepseek_v3"), **TP2, enable_expert_parallel=True, **features))


def test_dp_ep_features_are_accepted():
    """Under DP attention + EP, LoRA, MTP and quantization start (test_dp_ep.py runs them through vllm serve)."""
    features = dict(lora_config=object(), speculative_config=object(), quantization="ms_w8a8")
    check_vllm_parallel(_vllm_config(_tiny("deepseek_v3"), **DP2, enable_expert_parallel=True, **features))


def test_single_process_and_dense_dp_need_no_plan():
    check_vllm_parallel(_vllm_config(world_size=1, tensor_parallel_size=1, lora_config=object()))
    # a dense model's DP ranks are independent engines: any feature, no shards
    check_vllm_parallel(_vllm_config(**DP2, lora_config=object()))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(DP2), "needs enable_expert_parallel=True"),
        (dict(world_size=2, data_parallel_size=2, enable_expert_parallel=True), "DP attention runs with TP = 1"),
    ],
)
def test_unsupported_dp_settings_are_refused(settings, message):
    with pytest.raises(ParallelError, match=message):
        check_vllm_parallel(_vllm_config(_tiny("deepseek_v3"), **settings))
