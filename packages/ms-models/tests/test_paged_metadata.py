"""Properties of the paged-cache index bookkeeping, on random batches (no model involved)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_models import PagedMetadata
from ms_models.paged_cache import from_padded, gather_context, to_padded, write_cache

pytestmark = pytest.mark.needs_mindspore


@st.composite
def batches(draw):
    block = draw(st.sampled_from([1, 2, 4]))
    n = draw(st.integers(1, 4))
    seq_lens = [draw(st.integers(1, 9)) for _ in range(n)]
    q_lens = [draw(st.integers(1, s)) for s in seq_lens]
    need = [-(-s // block) for s in seq_lens]
    blocks = draw(st.permutations(list(range(sum(need) + 2))))
    tables, start = [], 0
    for k in need:
        tables.append(list(blocks[start : start + k]) + [0] * (max(need) - k))
        start += k
    positions = np.concatenate([np.arange(s - q, s) for s, q in zip(seq_lens, q_lens)])
    slots = np.concatenate(
        [[t[p // block] * block + p % block for p in range(s - q, s)] for t, s, q in zip(tables, seq_lens, q_lens)]
    )
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    return block, positions, slots, np.array(tables), np.array(seq_lens), starts, sum(need) + 2


@settings(max_examples=30, deadline=None)
@given(batches())
def test_metadata_reads_back_what_was_written(batch):
    import mindspore as ms

    block, positions, slots, tables, seq_lens, starts, num_blocks = batch
    meta = PagedMetadata.build(positions, slots, tables, seq_lens, starts, block)
    t = len(positions)
    # Fill the cache as earlier steps would have: entry = (sequence, position) for every context slot.
    cache = ms.Tensor(np.full((num_blocks, block, 2), -1.0, np.float32))
    values = np.stack([np.repeat(np.arange(len(seq_lens)), np.diff(starts)), positions], -1).astype(np.float32)
    write_cache(cache, ms.Tensor(values), meta)
    for s, (table, n) in enumerate(zip(tables, seq_lens)):
        for p in range(n - (starts[s + 1] - starts[s])):  # the part computed in earlier steps
            cache[int(table[p // block]), p % block] = ms.Tensor(np.array([s, p], np.float32))
    ctx = gather_context(cache, meta).asnumpy()
    allowed = meta.allowed.asnumpy()[:, 0]
    for s, n in enumerate(seq_lens):
        assert (ctx[s, :n, 0] == s).all() and (ctx[s, :n, 1] == np.arange(n)).all()
        for i in range(starts[s + 1] - starts[s]):
            pos = positions[starts[s] + i]
            assert allowed[s, i].tolist() == [j <= pos for j in range(allowed.shape[-1])]
    rows = ms.Tensor(np.arange(t, dtype=np.float32)[:, None])
    np.testing.assert_array_equal(from_padded(to_padded(rows, meta), meta).asnumpy()[:, 0], np.arange(t))
