"""Print the module tree of a real megatron-core GPTModel built on CPU, as JSON {path: class}.

    python megatron_tree.py llama|deepseek_v3

Tiny configs of the two families (GQA + SwiGLU; MLA with low-rank q and kv, a dense first layer
then MoE layers with shared experts), the local (non-Transformer-Engine) spec. Nothing runs: the
model is only built, which megatron-core 0.16 does on a CPU-only torch after three patches of
CUDA-only code paths that building (not the module tree) touches: RotaryEmbedding inside MLA asks
for the current CUDA device, MLA's Transformer Engine check is on when TE's wrappers import
without TE, and the local DotProductAttention does not take the MLA head sizes (k_channels,
v_channels), which only its forward would use. The alltoall token dispatcher allocates a CUDA
stream, so the MoE layers use the allgather one (same modules)."""

from __future__ import annotations

import json
import os
import sys


def build(kind: str):
    import torch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 2000))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    torch.cuda.current_device = lambda: "cpu"
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    mla.HAVE_TE = False
    common = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        use_cpu_initialization=True,
    )
    if kind == "llama":
        config = TransformerConfig(num_query_groups=2, **common)
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    elif kind == "deepseek_v3":
        config = MLATransformerConfig(
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_head_dim=16,
            qk_pos_emb_head_dim=8,
            v_head_dim=16,
            qk_layernorm=True,
            num_moe_experts=4,
            moe_router_topk=2,
            moe_ffn_hidden_size=32,
            moe_shared_expert_intermediate_size=64,
            moe_layer_freq=[0, 1],
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_token_dispatcher_type="allgather",
            rope_type="rope",
            **common,
        )

        class CoreAttention(DotProductAttention):
            def __init__(self, *args, k_channels=None, v_channels=None, cp_comm_type=None, **kwargs):
                super().__init__(*args, **kwargs)

        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = ModuleSpec(module=CoreAttention)
    else:
        raise SystemExit(f"kind {kind!r} is not llama or deepseek_v3")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=128,
        max_sequence_length=32,
        position_embedding_type="rope",
    )


if __name__ == "__main__":
    model = build(sys.argv[1])
    sys.stdout.write(json.dumps({name: type(m).__name__ for name, m in model.named_modules()}))
