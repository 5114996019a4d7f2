"""The PyTorch peer of bench_pipeline.py: the same Llama-shaped decoder in torch, run by
``torch.distributed.pipelining``'s own ``Schedule1F1B`` and ``ScheduleZBVZeroBubble`` on the same
gloo ranks (the world ms_layout.comm started), one thread each.

The model matches ms-models' Llama of the same config shape for shape (embedding, pre-norm GQA
attention with rotate-half RoPE, SwiGLU, final RMSNorm, untied LM head, mean cross-entropy);
attention is torch's fused ``scaled_dot_product_attention``, as a torch user would write it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Layer(nn.Module):
    """Pre-norm decoder layer: GQA attention with RoPE, then SwiGLU."""

    def __init__(self, c):
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, d
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _rope(self, x, cos, sin):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    def forward(self, x):
        b, s, _ = x.shape
        angles = torch.arange(s, dtype=torch.float32)[:, None] * self.inv_freq  # [s, d/2]
        cos, sin = angles.cos(), angles.sin()
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Piece(nn.Module):
    """One pipeline stage: optionally the embedding, some layers, optionally the final norm and head."""

    def __init__(self, c, layers: int, embed: bool, head: bool):
        super().__init__()
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size) if embed else None
        self.layers = nn.ModuleList(Layer(c) for _ in range(layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if head else None
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False) if head else None
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, 0.0, 1.0 / math.sqrt(p.shape[-1]))

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x if self.lm_head is None else self.lm_head(self.norm(x))


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def build(name: str, config, rank: int, ranks: int, microbatches: int, layer_counts: list[int]):
    """(schedule, this rank's modules) of torch's own ``name`` schedule ("1f1b" or "zbv")."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble

    num_stages = len(layer_counts)
    indices = [rank] if name == "1f1b" else [rank, num_stages - 1 - rank]  # the V
    modules, stages = [], []
    for s in indices:
        torch.manual_seed(s)
        module = Piece(config, layer_counts[s], embed=s == 0, head=s == num_stages - 1)
        modules.append(module)
        stages.append(PipelineStage(module, s, num_stages, torch.device("cpu")))
    if name == "1f1b":
        return Schedule1F1B(stages[0], microbatches, loss_fn=loss_fn), modules
    return ScheduleZBVZeroBubble(stages, microbatches, loss_fn=loss_fn), modules


def step(schedule, modules, rank: int, last_rank: int, ids, labels) -> None:
    """One training step (gradients zeroed first): the batch enters on rank 0, targets on the rank
    holding the last stage."""
    for module in modules:
        module.zero_grad(set_to_none=True)
    kwargs = {"target": labels, "losses": []} if rank == last_rank else {}
    if rank == 0:
        schedule.step(ids, **kwargs)
    else:
        schedule.step(**kwargs)
