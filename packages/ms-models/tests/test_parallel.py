"""ms_models.parallel: the sharded model on 2 gloo ranks (ms_layout.comm) against the same checkpoint
in one process (paged logits over a prefill then a decode step agree, for TP and TP + EP); a shard cut
from a model in memory equals the one read from its checkpoint."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ms_layout.testing import UNIT_ROUNDOFF as U
from ms_layout.testing import assert_close

PROMPT = [0, 17, 23, 99, 5, 61, 200, 31, 8]
BLOCK = 4
# Sharded vs one process: the row-parallel matmuls' sums split in halves and all-reduced, the expert
# outputs combined across ranks, so the logits agree to rounding relative to their scale; a length-n
# sum in another order is off by up to ~n*u of its terms. Sums over <= 128 (intermediate size) in
# each of <= 3 layers, then the head's over the hidden size (64): n ~ 3 * 128 + 64 < 512. Measured:
# <= 8.3e-7 of the scale, 2.4e-6 absolute (the old elementwise atol=1e-5 left 4x on near-zero logits).
RTOL = 512 * U  # ~3.1e-5


def _paged_logits(model, prompt, next_token):
    """Logits of a paged prefill of `prompt`, then of one decode step of `next_token`."""
    from ms_models import allocate_kv_caches

    caches = allocate_kv_caches(model, 8, BLOCK)
    n = len(prompt)
    table = np.arange(8, dtype=np.int32)[None]
    pre = model.forward_paged(
        np.array(prompt, np.int32),
        np.arange(n, dtype=np.int32),
        caches,
        np.arange(n, dtype=np.int32),
        table,
        np.array([n], np.int32),
        np.array([0, n], np.int32),
    )
    dec = model.forward_paged(
        np.array([next_token], np.int32),
        np.array([n], np.int32),
        caches,
        np.array([n], np.int32),
        table,
        np.array([n + 1], np.int32),
        np.array([0, 1], np.int32),
    )
    return pre.asnumpy(), dec.asnumpy()


def _rank(group, cases):
    """Each (path, expert_parallel) case's paged logits and parameter shapes on this rank."""
    import mindspore as ms

    from ms_models.parallel import ShardPlan, build_tp_model

    ms.set_device("CPU")
    out = []
    for path, expert_parallel in cases:
        model = build_tp_model(str(path), ShardPlan(group.size, group.rank, expert_parallel), group)
        sizes = {name: tuple(p.shape) for name, p in model.parameters_and_names()}
        out.append((_paged_logits(model, PROMPT, 42), sizes))
    return out


def _compare(tiny_dirs, run_ranks, cases):
    import mindspore as ms

    from ms_models import from_pretrained

    ms.set_device("CPU")
    results = run_ranks(_rank, nprocs=2, timeout=300, args=([(tiny_dirs[a], ep) for a, ep in cases],))
    for i, (arch, ep) in enumerate(cases):
        want_pre, want_dec = _paged_logits(from_pretrained(tiny_dirs[arch]), PROMPT, 42)
        for rank, rank_results in enumerate(results):
            (pre, dec), _ = rank_results[i]
            assert_close(pre, want_pre, RTOL, f"{arch} (EP={ep}) prefill logits, rank {rank}")
            assert_close(dec, want_dec, RTOL, f"{arch} (EP={ep}) decode logits, rank {rank}")
    return [r[1] for r in results[0]]


def test_dense_tp2_matches_one_process(tiny_dirs, run_ranks):
    """Llama (untied head) and Qwen2 (tied embeddings, q/k/v biases)."""
    for sizes in _compare(tiny_dirs, run_ranks, [("llama", False), ("qwen2", False)]):
        assert sizes["model.embed_tokens.weight"] == (160, 64)  # vocab-parallel: 320 / 2 rows
        assert sizes["model.layers.0.self_attn.k_proj.weight"] == (16, 64)  # 1 of 2 kv heads x 16
        assert sizes["model.layers.0.mlp.down_proj.weight"] == (64, 64)  # row-parallel: 128 / 2 inputs


def test_deepseek_tp2_ep2_matches_one_process(tiny_dirs, run_ranks):
    """DeepSeek-V3 with its routed experts split whole (EP=2) and split inside (TP=2)."""
    ep, tp = _compare(tiny_dirs, run_ranks, [("deepseek_v3", True), ("deepseek_v3", False)])
    assert ep["model.layers.1.mlp.experts.gate_proj"] == (4, 32, 64)  # 4 of 8 experts, whole
    assert tp["model.layers.1.mlp.experts.gate_proj"] == (8, 16, 64)  # all 8, half of each
    for sizes in (ep, tp):
        assert sizes["model.layers.1.mlp.gate.weight"] == (8, 64)  # the router sees every expert
        assert sizes["model.layers.1.mlp.shared_experts.gate_proj.weight"] == (16, 64)
        assert sizes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (24, 64)  # latent: replicated


def _in_memory_rank(group, path):
    """Each plan's shard cut from the whole model in memory and read from the checkpoint."""
    import mindspore as ms

    from ms_models import from_pretrained
    from ms_models.parallel import ShardPlan, build_tp_model, shard_model

    ms.set_device("CPU")
    full = from_pretrained(str(path))
    out = []
    for ep, vocab in ((False, True), (True, False)):
        plan = ShardPlan(group.size, group.rank, expert_parallel=ep, vocab_parallel=vocab)
        a, b = shard_model(full, plan, group), build_tp_model(str(path), plan, group)
        pa, pb = dict(a.parameters_and_names()), dict(b.parameters_and_names())
        out.append((sorted(pa) == sorted(pb), {n: bool(np.array_equal(pa[n].asnumpy(), pb[n].asnumpy())) for n in pa}))
        out[-1] += (tuple(a.model.embed_tokens.weight.shape),)
    return out


def test_shard_in_memory_equals_checkpoint_read(tiny_dirs, run_ranks):
    """shard_model (ms-recompute's TP training path) and build_tp_model (ms-vllm's) cut the same
    slices; without vocabulary parallelism the embedding stays whole."""
    results = run_ranks(_in_memory_rank, nprocs=2, timeout=300, args=(tiny_dirs["deepseek_v3"],))
    for rank, per_plan in enumerate(results):
        (same_names, equal, embed), (same_names2, equal2, embed2) = per_plan
        assert same_names and same_names2, f"rank {rank}: parameter names differ"
        assert all(equal.values()) and all(equal2.values()), f"rank {rank}: {[n for n, ok in equal.items() if not ok]}"
        assert embed == (160, 64) and embed2 == (320, 64), (embed, embed2)


def test_plan_errors_name_the_value():
    from ms_models import tiny_config
    from ms_models.parallel import ParallelError, ShardPlan, local_config

    with pytest.raises(ParallelError, match="num_key_value_heads=2"):
        local_config(tiny_config("llama"), ShardPlan(4, 0))
    with pytest.raises(ParallelError, match="rank=3"):
        ShardPlan(2, 3)


def _training_rank(group, arch):
    """Loss and gradients of a TP training shard on packed rows (two samples in one row)."""
    import mindspore as ms

    from ms_models import from_config, tiny_config
    from ms_models.parallel import training_shard

    ms.set_device("CPU")
    net = training_shard(from_config(tiny_config(arch), seed=3), group)
    return _loss_and_grads(net)


def _loss_and_grads(model):
    """Cross-entropy of a packed row and {parameter name: gradient}, computed in PyNative."""
    import mindspore as ms
    from mindspore import Tensor, ops

    rng = np.random.default_rng(0)
    ids = Tensor(rng.integers(0, model.config.vocab_size, (2, 12)).astype(np.int32))
    positions = Tensor(np.array([list(range(7)) + list(range(5))] * 2, np.int32))
    segments = Tensor(np.array([[0] * 7 + [1] * 5] * 2, np.int32))
    targets = Tensor(rng.integers(0, model.config.vocab_size, (2, 12)).astype(np.int32))
    names = [n for n, _ in model.parameters_and_names()]
    params = [p for _, p in model.parameters_and_names()]

    def loss(ids, positions, segments, targets):
        logp = ops.log_softmax(model(ids, positions, segments), -1)
        return -ops.gather_elements(logp, -1, targets.expand_dims(-1)).mean()

    value, grads = ms.value_and_grad(loss, None, params)(ids, positions, segments, targets)
    return float(value.asnumpy()), {n: g.asnumpy() for n, g in zip(names, grads)}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_training_shard_tp2_gradients_match_one_process(run_ranks, arch):
    """Megatron's f and g make the shard's backward the full model's: each rank's gradient of a
    sharded weight is its slice of the full gradient (training_layouts says which), and every
    replicated weight gets the full gradient on both ranks."""
    import mindspore as ms

    from ms_layout import ParallelConfig
    from ms_models import from_config, tiny_config
    from ms_models.parallel import training_layouts

    ms.set_device("CPU")
    config = tiny_config(arch)
    want_loss, want = _loss_and_grads(from_config(config, seed=3))
    results = run_ranks(_training_rank, nprocs=2, timeout=300, args=(arch,))
    layouts = training_layouts(config, ParallelConfig(tp=2))
    sharded = 0
    for rank, (loss, grads) in enumerate(results):
        assert abs(loss - want_loss) <= RTOL * abs(want_loss)
        assert set(grads) == set(want)
        for name, grad in grads.items():
            index = layouts[name].global_slice(want[name].shape, rank)
            sharded += grad.shape != want[name].shape
            assert_close(grad, want[name][index], RTOL, f"TP=2 gradient of {name}, rank {rank}")
    projections = [n for n in want if re.search(r"(q|k|v|o|gate|up|down)_proj\.(weight|bias)$", n)]
    assert sharded == 2 * len(projections) > 0  # each rank holds a slice of every projection, nothing else
