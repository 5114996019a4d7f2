"""Shape buckets and padding plans (numpy only): which bucket a part gets, how a step is split,
and that padding writes only the scratch block."""

from __future__ import annotations

import pytest

from ms_vllm.buckets import Bucket, BucketConfig, BucketError, pad_part, plan_step

CONFIG = BucketConfig(decode_sizes=(1, 2, 4), prefill_sizes=(8, 16), context_sizes=(32, 96))


def test_default_config_is_powers_of_two_up_to_the_limits():
    c = BucketConfig.default(max_num_seqs=48, max_model_len=250, block_size=16)
    assert c.decode_sizes == (1, 2, 4, 8, 16, 32, 48)
    assert c.prefill_sizes == (16, 32, 64, 128, 256)
    assert c.context_sizes == (128, 256)  # 250 rounded up to whole blocks
    # prefill graphs only where the chunk fits its context: 4 of the 5 sizes under 128, all 5 under 256,
    # each alone and (but 256) batched to 256 tokens: 16 x 16, 8 x 32, 4 x 64, 2 x 128
    assert len(c.buckets()) == 7 * 2 + 2 * 4 + (2 * 4 + 1)
    assert Bucket("prefill", 32, 128, 8) in c.buckets() and Bucket("prefill", 32, 128, 8).tokens == 256


def test_bad_configs_name_the_bad_value():
    with pytest.raises(BucketError, match=r"decode_sizes=\(4, 2\)"):
        BucketConfig(decode_sizes=(4, 2), prefill_sizes=(8,), context_sizes=(32,))
    with pytest.raises(BucketError, match="prefill size 64 exceeds the largest context size 32"):
        BucketConfig(decode_sizes=(1,), prefill_sizes=(64,), context_sizes=(32,))
    with pytest.raises(BucketError, match="unknown compile options"):
        BucketConfig.from_dict({"decode": [1]}, CONFIG)
    with pytest.raises(BucketError, match="batch_tokens=-1"):
        BucketConfig.from_dict({"batch_tokens": -1}, CONFIG)


def test_bucket_choice_rounds_up():
    assert CONFIG.decode_bucket(3, 40) == Bucket("decode", 4, 96)
    assert CONFIG.decode_bucket(5, 10) is None  # more requests than the largest decode graph
    assert CONFIG.prefill_bucket(9, 9) == Bucket("prefill", 16, 32)
    assert CONFIG.prefill_bucket(17, 17) is None
    assert CONFIG.decode_bucket(1, 97) is None


def test_plan_splits_decodes_and_chunks():
    # requests: decode, 12-token prefill, decode, draft verification (2 rows), decode x3, 40-token chunk
    q_lens = [1, 12, 1, 2, 1, 1, 1, 40]
    seq_lens = [30, 12, 60, 20, 5, 6, 7, 40]
    rows = [1, 1, 1, 2, 1, 1, 1, 0]
    parts = plan_step(q_lens, seq_lens, rows, CONFIG)
    decode = [p for p in parts if p.bucket is not None and p.bucket.kind == "decode"]
    assert [p.requests for p in decode] == [[0, 2, 4, 5], [6]]  # at most 4 per decode graph
    assert decode[0].bucket == Bucket("decode", 4, 96) and decode[1].bucket == Bucket("decode", 1, 32)
    by_req = {p.requests[0]: p for p in parts if p not in decode}
    assert by_req[1].bucket == Bucket("prefill", 16, 32)
    assert by_req[3].bucket is None and "draft" in by_req[3].reason
    assert by_req[7].bucket is None and "40 tokens" in by_req[7].reason
    assert sorted(i for p in parts for i in p.requests) == list(range(8))


def test_plan_batches_short_prefills_by_size():
    config = BucketConfig(decode_sizes=(1, 2), prefill_sizes=(8, 16), context_sizes=(32, 96), batch_tokens=32)
    # six 5-8 token prompts (size 8: 4 per graph), three 12-16 token ones (size 16: 2 per graph), a decode
    q_lens = [5, 12, 8, 6, 16, 7, 1, 8, 13]
    seq_lens = [5, 12, 8, 6, 16, 7, 40, 8, 13]
    parts = plan_step(q_lens, seq_lens, [1] * 9, config)
    by = {tuple(p.requests): p.bucket for p in parts}
    assert by[(6,)] == Bucket("decode", 1, 96)
    assert by[(0, 2, 3, 5)] == Bucket("prefill", 8, 32, 4)
    assert by[(7,)] == Bucket("prefill", 8, 32)  # 1 of 4 left: alone, not padded with 3 empty requests
    assert by[(1, 4)] == Bucket("prefill", 16, 32, 2)
    assert by[(8,)] == Bucket("prefill", 16, 32, 2)  # 1 of 2: half full, so batched
    assert sorted(i for p in parts for i in p.requests) == list(range(9))
    # a batched part pads to n requests of Q tokens; a chunk longer than Q is refused
    p = pad_part([1] * 13, list(range(5)) + list(range(8)), list(range(13)), [[0], [1]], [5, 8], [0, 5, 13],
                 [4, 12], Bucket("prefill", 8, 32, 4), 7, 16)  # fmt: skip
    assert len(p.input_ids) == 32 and p.query_start_loc.tolist() == [0, 5, 13, 13, 13]
    assert p.logits_rows.tolist() == [4, 12, 0, 0] and (p.slot_mapping[13:] // 16 == 7).all()
    with pytest.raises(BucketError, match="a chunk of 9 tokens"):
        pad_part([1] * 9, list(range(9)), list(range(9)), [[0]], [9], [0, 9], [8], Bucket("prefill", 8, 32, 4), 7, 16)


def test_padding_writes_only_the_scratch_block():
    block, scratch = 4, 9
    # two decodes: request A (blocks 3, 1) at position 5, request B (block 6) at position 2
    p = pad_part(
        input_ids=[11, 12],
        positions=[5, 2],
        slot_mapping=[1 * block + 1, 6 * block + 2],
        block_tables=[[3, 1], [6, 0]],
        seq_lens=[6, 3],
        query_start_loc=[0, 1, 2],
        logits_rows=[0, 1],
        bucket=Bucket("decode", 4, 32),
        scratch_block=scratch,
        block_size=block,
    )
    assert p.input_ids.tolist() == [11, 12, 0, 0]
    assert p.slot_mapping[:2].tolist() == [5, 26]
    assert (p.slot_mapping[2:] // block == scratch).all()  # padding tokens: scratch slots only
    assert p.seq_lens.tolist() == [6, 3, 0, 0]  # padding requests: empty context ...
    assert p.query_start_loc.tolist() == [0, 1, 2, 2, 2]  # ... and empty queries
    assert (p.block_tables[2:] == scratch).all()
    assert p.logits_rows.tolist() == [0, 1, 0, 0]
    with pytest.raises(BucketError, match="scratch block 9"):
        pad_part([1], [0], [0], [[9]], [1], [0, 1], [0], Bucket("decode", 1, 32), scratch, block)
    with pytest.raises(BucketError, match="context 40 does not fit"):
        pad_part([1], [39], [0], [[1] * 10], [40], [0, 1], [0], Bucket("decode", 1, 32), scratch, block)


def test_speculative_steps_take_verify_and_draft_buckets():
    """With 1 draft per step (spec_width 2): a verification (2 tokens, both sampled) takes a verify
    bucket, and the drafter's requests of 2 accepted positions (one row each) a draft bucket; wider
    verifications than spec_width still run eagerly."""
    import dataclasses

    config = dataclasses.replace(CONFIG, spec_width=2)
    assert Bucket("verify", 4, 96, width=2) in config.buckets()
    assert Bucket("draft", 4, 96, width=2) in config.buckets(drafting=True)
    assert not any(b.kind == "draft" for b in config.buckets())
    v = Bucket("verify", 4, 32, width=2)
    assert (v.tokens, v.seqs, v.query, v.rows, str(v)) == (8, 4, 2, 8, "verify[B=4,C=32,W=2]")
    d = Bucket("draft", 2, 32, width=2)
    assert (d.tokens, d.seqs, d.query, d.rows) == (4, 2, 2, 2)
    # target step: decode, two verifications, a 3-row verification (too wide), a prefill chunk
    parts = plan_step([1, 2, 2, 3, 12], [10, 20, 30, 40, 12], [1, 2, 2, 3, 1], config)
    by_kind = {p.bucket.kind if p.bucket else None: p for p in parts}
    assert by_kind["verify"].requests == [1, 2] and by_kind["verify"].bucket == Bucket("verify", 2, 32, width=2)
    assert by_kind[None].requests == [3] and "beyond spec_width" in by_kind[None].reason
    # the drafter's step: 1 or 2 accepted positions, one row each (or none: a prompt chunk mid-way)
    parts = plan_step([1, 2, 2, 12], [10, 20, 30, 12], [1, 1, 1, 0], config, drafting=True)
    assert sorted((p.bucket.kind, tuple(p.requests)) for p in parts) == [
        ("decode", (0,)),
        ("draft", (1, 2)),
        ("prefill", (3,)),
    ]
    with pytest.raises(BucketError, match="spec_width=1"):
        dataclasses.replace(CONFIG, spec_width=1)


def test_padding_a_verify_part_keeps_every_row():
    config_bucket = Bucket("verify", 2, 32, width=2)
    p = pad_part([5, 6, 7], [3, 4, 9], [13, 14, 21], [[3], [5]], [5, 10], [0, 2, 3], [0, 1, 2], config_bucket, 7, 4)
    assert len(p.input_ids) == 4 and list(p.logits_rows) == [0, 1, 2, 0]
    assert list(p.slot_mapping[3:]) == [28]  # the padding token writes the scratch block 7
