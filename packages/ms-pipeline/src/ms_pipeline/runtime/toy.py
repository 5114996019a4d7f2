"""A tiny transformer-ish model in blocks, for examples, the CLI's ``run`` and the benchmark.

Blocks: a token embedding, then pairs of (self-attention, MLP) residual blocks with pre-norm, then
a head that returns the mean cross-entropy of next-token style labels. Only ops with CPU kernels
in MindSpore 2.10 are used (``nn.Embedding``, ``nn.Dense``, ``nn.LayerNorm``, ``ops.softmax``,
``ops.cross_entropy``; see docs/mindspore-cpu.md §11). Weights are set from a
numpy generator by parameter name, so every rank and the single-process reference build
bit-identical models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from ..placement import LayerPlacement


class Embed(nn.Cell):
    """Token ids [b, s] -> hidden [b, s, d]."""

    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)

    def construct(self, ids):
        return self.embedding(ids)


class Attention(nn.Cell):
    """Pre-norm causal self-attention with a residual (manual softmax attention)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.dh = heads, d // heads
        self.norm = nn.LayerNorm((d,))
        self.qkv = nn.Dense(d, 3 * d)
        self.out = nn.Dense(d, d)

    def construct(self, x):
        b, s, d = x.shape
        qkv = self.qkv(self.norm(x)).reshape(b, s, 3, self.heads, self.dh).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = ops.matmul(q, k.transpose(0, 1, 3, 2)) / math.sqrt(self.dh)
        mask = ms.Tensor(np.triu(np.full((s, s), -1e9, dtype=np.float32), 1))
        attn = ops.softmax(scores + mask, axis=-1)
        y = ops.matmul(attn, v).transpose(0, 2, 1, 3).reshape(b, s, d)
        return x + self.out(y)


class MLP(nn.Cell):
    """Pre-norm MLP with a residual."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm((d,))
        self.up = nn.Dense(d, 4 * d)
        self.down = nn.Dense(4 * d, d)

    def construct(self, x):
        return x + self.down(ops.gelu(self.up(self.norm(x))))


class Head(nn.Cell):
    """(hidden, labels) -> mean cross-entropy over the tokens of the microbatch."""

    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm((d,))
        self.proj = nn.Dense(d, vocab)

    def construct(self, x, labels):
        logits = self.proj(self.norm(x))
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class ToyModel(nn.Cell):
    """Embedding, ``layers`` x (attention, MLP), head: ``2 * layers + 2`` blocks."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 4, heads: int = 4, seed: int = 0):
        super().__init__()
        cells: list[nn.Cell] = [Embed(vocab, d)]
        for _ in range(layers):
            cells += [Attention(d, heads), MLP(d)]
        cells.append(Head(d, vocab))
        self.blocks = nn.CellList(cells)
        self.reset(seed)

    def reset(self, seed: int) -> None:
        """Set every weight from a numpy generator, in name order (identical on every process)."""
        rng = np.random.default_rng(seed)
        for p in sorted(self.trainable_params(), key=lambda p: p.name):
            if "norm" in p.name:
                value = np.ones(p.shape) if p.name.endswith("gamma") else np.zeros(p.shape)
            else:
                value = rng.standard_normal(p.shape) * (0.02 if "embedding" in p.name else 1 / math.sqrt(p.shape[-1]))
            p.set_data(ms.Tensor(value.astype(np.float32)))

    def construct(self, ids, labels):
        # index, never slice: slicing a CellList builds a new one, which renames the parameters
        x = ids
        n = len(self.blocks)
        for i in range(n - 1):
            x = self.blocks[i](x)
        return self.blocks[n - 1](x, labels)


def split_blocks(blocks: Sequence[nn.Cell], placement: LayerPlacement) -> dict[int, list[nn.Cell]]:
    """Blocks of each stage under a layer placement (blocks are the "layers" here)."""
    if placement.num_layers != len(blocks):
        raise ValueError(f"placement covers {placement.num_layers} blocks, the model has {len(blocks)}")
    return {s: [blocks[i] for i in placement.layers(s)] for s in range(placement.num_stages)}


def toy_batch(num_microbatches: int, micro_batch: int, seq: int, vocab: int, seed: int = 1) -> tuple[list, list]:
    """Random token ids and their next-token labels, one pair per microbatch."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(num_microbatches, micro_batch, seq + 1)).astype(np.int32)
    return [ms.Tensor(x[:, :-1]) for x in ids], [ms.Tensor(x[:, 1:]) for x in ids]


def reference_step(model: nn.Cell, inputs: Sequence, labels: Sequence) -> tuple[float, dict[str, np.ndarray]]:
    """Single-process reference: mean loss over the microbatches and its gradient by name."""
    params = model.trainable_params()
    m = len(inputs)

    def mean_loss():
        total = model(inputs[0], labels[0])
        for i in range(1, m):
            total = total + model(inputs[i], labels[i])
        return total / m

    loss, grads = ms.value_and_grad(mean_loss, grad_position=None, weights=params)()
    return float(loss.asnumpy()), {p.name: g.asnumpy() for p, g in zip(params, grads)}
