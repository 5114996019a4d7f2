"""DeepSeek-V3 MTP against an independent torch implementation of its formula.

HF's DeepseekV3ForCausalLM skips the MTP weights, so the reference is assembled here from torch
ops and HF's own DeepseekV3DecoderLayer, loaded with the checkpoint's `model.layers.3.*` tensors.
"""

import numpy as np
import pytest
from conftest import hf_model, random_ids, rel_err

from ms_models import ModelError, read_safetensors

pytestmark = [pytest.mark.needs_torch, pytest.mark.needs_mindspore]


def _torch_mtp(directory, ids, next_ids):
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    main = hf_model(directory)
    cfg = main.config
    tensors = {k: torch.from_numpy(v) for k, v in read_safetensors(directory).items()}
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    mine = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    layer = DeepseekV3DecoderLayer(cfg, layer_idx=cfg.num_hidden_layers).eval()
    state = {k: v for k, v in mine.items() if k.split(".")[0] in ("self_attn", "mlp") and ".experts." not in k}
    state.update({k: mine[k] for k in ("input_layernorm.weight", "post_attention_layernorm.weight")})
    experts = range(cfg.n_routed_experts)
    gate = torch.stack([mine[f"mlp.experts.{e}.gate_proj.weight"] for e in experts])
    up = torch.stack([mine[f"mlp.experts.{e}.up_proj.weight"] for e in experts])
    state["mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
    state["mlp.experts.down_proj"] = torch.stack([mine[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    layer.load_state_dict(state, strict=True)

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    with torch.no_grad():
        ids_t, next_t = torch.from_numpy(ids).long(), torch.from_numpy(next_ids).long()
        hidden = main.model(ids_t).last_hidden_state  # final normed hidden states
        embeds = main.model.embed_tokens(next_t)
        x = (
            torch.cat([rms(embeds, mine["enorm.weight"]), rms(hidden, mine["hnorm.weight"])], -1)
            @ mine["eh_proj.weight"].T
        )
        seq = ids.shape[1]
        positions = torch.arange(seq)[None]
        mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
        x = layer(x, attention_mask=mask, position_embeddings=main.model.rotary_emb(x, positions))
        logits = rms(x, mine["shared_head.norm.weight"]) @ mine["shared_head.head.weight"].T
    return logits.numpy(), x.numpy()


def test_mtp_matches_torch_reference(tiny_dirs, tiny_models):
    import mindspore as ms

    model = tiny_models["deepseek_v3"]
    ids = random_ids(2, 12, seed=5)
    next_ids = np.roll(ids, -1, axis=1)  # t_{i+1}: the MTP module then predicts t_{i+2}
    ref_logits, ref_hidden = _torch_mtp(tiny_dirs["deepseek_v3"], ids, next_ids)
    hidden = model.hidden_states(ms.Tensor(ids))
    logits, out = model.mtp_forward(hidden, ms.Tensor(next_ids))
    assert logits.shape == (2, 12, 320)
    assert rel_err(logits.asnumpy(), ref_logits) < 1e-4
    assert rel_err(out.asnumpy(), ref_hidden) < 1e-4


def test_mtp_depth_is_checked(tiny_models):
    import mindspore as ms

    model = tiny_models["deepseek_v3"]
    hidden = model.hidden_states(ms.Tensor(random_ids(1, 4)))
    with pytest.raises(ModelError, match="depth 1"):
        model.mtp_forward(hidden, ms.Tensor(random_ids(1, 4)), depth=1)


def test_mtp_weight_names_follow_deepseek_checkpoint(tiny_dirs):
    names = read_safetensors(tiny_dirs["deepseek_v3"])
    assert "model.layers.3.mlp.experts.0.gate_proj.weight" in names  # the MTP block is a MoE layer
    assert "model.layers.3.self_attn.kv_b_proj.weight" in names
    assert np.array_equal(names["model.layers.3.embed_tokens.weight"], names["model.embed_tokens.weight"])


def test_mtp_paged_equals_training_path(tiny_models):
    """A drafter's view: main-model hidden states from the paged path, then the MTP module over its
    own paged cache (a 6-row prefill, then one row at a time) equals mtp_forward on the full rows."""
    import mindspore as ms

    model = tiny_models["deepseek_v3"]
    ids = random_ids(1, 10, seed=9)
    next_ids = np.roll(ids, -1, axis=1)
    ref_logits, ref_hidden = model.mtp_forward(model.hidden_states(ms.Tensor(ids)), ms.Tensor(next_ids))
    ref_logits, ref_hidden = ref_logits.asnumpy()[0], ref_hidden.asnumpy()[0]

    caches = model.allocate_kv_caches(num_blocks=4, block_size=4)
    (mtp_cache,) = model.allocate_mtp_kv_caches(num_blocks=4, block_size=4)
    blocks = [3, 0, 2]
    table = np.array([blocks], np.int32)
    done = 0
    for n in [6, 1, 1, 1, 1]:
        span = np.arange(done, done + n)
        slots = np.array([blocks[p // 4] * 4 + p % 4 for p in span])
        lens, starts = np.array([done + n]), np.array([0, n])
        _, hidden = model.forward_paged(ids[0, span], span, caches, slots, table, lens, starts, return_hidden=True)
        logits, out = model.mtp_forward_paged(next_ids[0, span], span, hidden, mtp_cache, slots, table, lens, starts)
        assert rel_err(logits.asnumpy(), ref_logits[span]) < 1e-5
        assert rel_err(out.asnumpy(), ref_hidden[span]) < 1e-5
        done += n
