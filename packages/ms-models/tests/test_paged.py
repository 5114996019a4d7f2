"""The paged-KV inference path: same logits as the training path and as HF, greedy == recompute."""

import numpy as np
import pytest
from conftest import ARCHS, hf_model, random_ids, rel_err

from ms_models import ModelError, PagedMetadata
from ms_models.generate import BlockAllocator, generate_greedy, generate_greedy_recompute

pytestmark = pytest.mark.needs_mindspore
BLOCK = 4


def _prefill_batch(lengths, allocator, seed=3):
    """Flat-batch inputs for prefilling sequences of `lengths` into shuffled blocks."""
    prompts = [random_ids(1, n, seed=seed + i)[0] for i, n in enumerate(lengths)]
    ids, positions, slots, tables = [], [], [], []
    width = max(-(-n // BLOCK) for n in lengths)
    for prompt in prompts:
        blocks = [allocator.allocate() for _ in range(-(-len(prompt) // BLOCK))]
        tables.append(blocks + [0] * (width - len(blocks)))
        ids += prompt.tolist()
        positions += list(range(len(prompt)))
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(prompt))]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return prompts, (np.array(ids), np.array(positions), np.array(slots), np.array(tables), np.array(lengths), starts)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_prefill_equals_training_path(arch, tiny_models):
    import mindspore as ms

    model = tiny_models[arch]
    caches = model.allocate_kv_caches(num_blocks=16, block_size=BLOCK)
    prompts, (ids, pos, slots, tables, lens, starts) = _prefill_batch([5, 9, 1], BlockAllocator(16, shuffle_seed=1))
    paged = model.forward_paged(ids, pos, caches, slots, tables, lens, starts).asnumpy()
    for prompt, a, b in zip(prompts, starts[:-1], starts[1:]):
        full = model(ms.Tensor(prompt[None])).asnumpy()[0]
        assert rel_err(paged[a:b], full) < 1e-5


@pytest.mark.needs_torch
@pytest.mark.parametrize("arch", ARCHS)
def test_token_by_token_decode_matches_transformers(arch, tiny_dirs, tiny_models):
    """Prefill 6 tokens, a 3-token prefill chunk, then 7 decodes; every step's logits match HF on the full prefix."""
    import torch

    model = tiny_models[arch]
    tokens = random_ids(1, 16, seed=11)[0]
    with torch.no_grad():
        ref = hf_model(tiny_dirs[arch])(torch.from_numpy(tokens[None]).long()).logits.numpy()[0]
    caches = model.allocate_kv_caches(num_blocks=8, block_size=BLOCK)
    blocks = [5, 2, 7, 0]  # not contiguous
    table = np.array([blocks], np.int32)
    done = 0
    for n in [6, 3] + [1] * 7:
        span = np.arange(done, done + n)
        slots = np.array([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in span])
        logits = model.forward_paged(
            tokens[span], span, caches, slots, table, np.array([done + n]), np.array([0, n])
        ).asnumpy()
        assert rel_err(logits, ref[span]) < 1e-4, f"step at position {done}"
        done += n


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_paged_equals_recompute(arch, tiny_models):
    model = tiny_models[arch]
    prompts = [random_ids(1, n, seed=20 + n)[0].tolist() for n in (3, 7, 1)]
    paged = generate_greedy(model, prompts, max_new_tokens=6, block_size=BLOCK, shuffle_seed=4)
    assert paged == [generate_greedy_recompute(model, p, 6) for p in prompts]


def test_padding_tokens_are_not_written(tiny_models):
    model = tiny_models["llama"]
    caches = model.allocate_kv_caches(num_blocks=4, block_size=BLOCK)
    ids, pos = np.array([7, 8, 9, 0, 0]), np.array([0, 1, 2, 0, 0])
    slots = np.array([4, 5, 6, -1, -1])  # block 1; two padding rows at the end
    logits = model.forward_paged(ids, pos, caches, slots, np.array([[1]]), np.array([3]), np.array([0, 3]))
    assert logits.shape == (5, 320)
    k_cache = caches[0][0].asnumpy()
    assert np.abs(k_cache[1, :3]).sum() > 0
    assert np.abs(np.delete(k_cache, 1, axis=0)).sum() == 0 and np.abs(k_cache[1, 3]).sum() == 0


def test_mla_cache_holds_latent_and_rope_key(tiny_models):
    model = tiny_models["deepseek_v3"]
    caches = model.allocate_kv_caches(num_blocks=2, block_size=BLOCK)
    config = model.config
    assert tuple(caches[0].shape) == (2, BLOCK, config.kv_lora_rank + config.qk_rope_head_dim)
    assert len(caches) == config.num_hidden_layers


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(query_start_loc=[0, 2]), "disagree"),
        (dict(seq_lens=[1, 3]), "query is longer"),
        (dict(block_tables=[[0], [1]], seq_lens=[2, 9]), "exceed block_tables"),
        (dict(slot_mapping=[0, 1, 2]), "do not describe"),
    ],
)
def test_bad_paged_inputs(kwargs, match):
    args = dict(
        positions=[0, 1, 0, 1],
        slot_mapping=[0, 1, 4, 5],
        block_tables=[[0, 2], [1, 3]],
        seq_lens=[2, 2],
        query_start_loc=[0, 2, 4],
        block_size=BLOCK,
    )
    args.update(kwargs)
    with pytest.raises(ModelError, match=match):
        PagedMetadata.build(**args)
