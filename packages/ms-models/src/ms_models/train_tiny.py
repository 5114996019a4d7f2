"""A tiny model trained for real on a small synthetic corpus, so that what depends on a model that
has learned something (MTP draft acceptance, quantization error, perplexity) means something.

`train_tiny(arch, path)` builds the tiny config (tiny.py) with its default initialisation, trains it
with Adam on `corpus_text()` under `mindspore.jit` (one compiled step: forward, loss, gradients and
the update), and writes an HF directory like `make_tiny`'s (weights, tokenizer, manifest) plus
`training.json` (losses, held-out perplexity, seconds). DeepSeek-V3 trains its MTP module too, as
DeepSeek-V3 does: loss = CE(next token) + mtp_weight * CE(token two ahead from the MTP module).

The corpus is generated, not downloaded: sentences drawn from fixed templates (arithmetic facts,
counting, word lists, and the tokenizer's own corpus), seeded, so the text has structure a small
model can learn and every machine writes the same checkpoint.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from .errors import ModelError

_WORDS = ("model", "graph", "layer", "token", "expert", "cache", "block", "head", "router", "kernel")
_ADJ = ("quick", "small", "sparse", "dense", "shared", "paged", "compiled", "latent")


def corpus_text(seed: int = 0, sentences: int = 3000) -> str:
    """Seeded synthetic text: sums and products, counting runs, template sentences, the
    tokenizer's corpus; learnable, and encodable by the tiny byte-level tokenizer."""
    from .tiny import _CORPUS

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(sentences):
        kind = rng.integers(0, 4)
        if kind == 0:
            a, b = (int(x) for x in rng.integers(0, 50, 2))
            out.append(f"{a} + {b} = {a + b}.")
        elif kind == 1:
            start = int(rng.integers(0, 90))
            out.append("count: " + " ".join(str(start + i) for i in range(int(rng.integers(4, 9)))) + ".")
        elif kind == 2:
            adj, word, other = rng.choice(_ADJ), rng.choice(_WORDS), rng.choice(_WORDS)
            out.append(f"The {adj} {word} feeds the {other}, and the {other} feeds the next {word}.")
        else:
            sentences_ = _CORPUS.split(". ")
            out.append(sentences_[int(rng.integers(0, len(sentences_)))].rstrip(".") + ".")
    return " ".join(out)


def _windows(ids: np.ndarray, rng, batch: int, width: int) -> np.ndarray:
    starts = rng.integers(0, ids.size - width, batch)
    return np.stack([ids[s : s + width] for s in starts]).astype(np.int32)


def train_tiny(
    arch: str,
    path: str | os.PathLike,
    steps: int = 600,
    seed: int = 0,
    seq_len: int = 64,
    batch: int = 16,
    lr: float = 3e-3,
    mtp_weight: float = 0.3,
    **overrides,
) -> dict:
    """Train the tiny `arch` model (config fields changed by `overrides`, e.g. hidden_size=256) on the
    synthetic corpus and write it to `path`; returns the report."""
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from .io import from_config, save_safetensors, write_manifest
    from .layers import causal_mask
    from .tiny import build_tokenizer, save_tokenizer, tiny_config

    for name, value, low in (("steps", steps, 1), ("seq_len", seq_len, 2), ("batch", batch, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ModelError(f"{name}={value!r}; expected an int >= {low}")
    config = tiny_config(arch, **overrides)
    if seq_len + 2 > config.max_position_embeddings:
        raise ModelError(
            f"seq_len={seq_len} needs {seq_len + 2} positions; the model has {config.max_position_embeddings}"
        )
    model = from_config(config, seed=seed)
    mtp = getattr(model.model, "mtp_layers", None) is not None
    tokenizer = build_tokenizer(config.vocab_size)
    ids = np.asarray(tokenizer.encode(corpus_text(seed)).ids, np.int32)
    split = int(ids.size * 0.9)
    train_ids, held_out = ids[:split], ids[split:]
    params = model.trainable_params()
    optimizer = nn.Adam(params, learning_rate=lr)

    def ce(logits, targets):
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    positions = Tensor(np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len)).copy())
    mask = causal_mask(positions, None)

    def loss_fn(window):
        inputs, next1 = window[:, :seq_len], window[:, 1 : seq_len + 1]
        hidden = model.hidden_states(inputs, positions)
        loss = ce(model.compute_logits(hidden), next1)
        if mtp:  # the MTP module sees h_i and token i+1, and predicts token i+2 (mtp.py's formula)
            layer = model.model.mtp_layers[0]
            cos, sin = model.model.rotary_emb(positions)
            x = layer(layer.combine(model.model.embed_tokens(next1), hidden), cos, sin, mask)
            loss = loss + mtp_weight * ce(model.compute_logits(layer.shared_head(x)), window[:, 2 : seq_len + 2])
        return loss

    grad_fn = ms.value_and_grad(loss_fn, None, params)

    @ms.jit
    def train_step(window):
        loss, grads = grad_fn(window)
        optimizer(grads)
        return loss

    @ms.jit
    def eval_loss(window):
        return ce(model(window[:, :seq_len], positions), window[:, 1 : seq_len + 1])

    model.set_train(True)
    rng = np.random.default_rng(seed)
    start, losses = time.perf_counter(), []
    for _ in range(steps):
        losses.append(float(train_step(Tensor(_windows(train_ids, rng, batch, seq_len + 2))).asnumpy()))
    seconds = time.perf_counter() - start
    model.set_train(False)
    eval_rng = np.random.default_rng(seed + 1)
    held = float(
        np.mean([eval_loss(Tensor(_windows(held_out, eval_rng, batch, seq_len + 2))).asnumpy() for _ in range(8)])
    )
    directory = os.fspath(path)
    save_safetensors(model, directory)
    save_tokenizer(directory, config.vocab_size, config.max_position_embeddings)
    write_manifest(directory, ["tokenizer.json"])
    report = {
        "arch": arch,
        "overrides": overrides,
        "steps": steps,
        "seed": seed,
        "tokens_per_step": batch * seq_len,
        "corpus_tokens": int(ids.size),
        "first_loss": losses[0],
        "final_loss": float(np.mean(losses[-20:])),
        "held_out_loss": held,
        "held_out_perplexity": float(np.exp(held)),
        "train_s": round(seconds, 1),
        "losses": [round(x, 4) for x in losses[:: max(1, steps // 50)]],
    }
    with open(os.path.join(directory, "training.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


__all__ = ["corpus_text", "train_tiny"]
