"""The policy side in MindSpore: building the models, token log-probs and the GRPO loss on rows.

Rows come from ms_rlhf.loss.build_row (packs or padded samples; positions restart per sample and
segment ids keep samples from attending to each other, through ms_models' training forward). The
loss is sum(w * (pg + beta * kl)) with the per-token weights of loss.sample_weights, so micro-batch
losses and gradients simply add up (see loss.py for why that is exact).

Both functions run under ``mindspore.jit`` when asked: rows are then padded to one width, so the
graph compiles once (PyNative dispatch costs ~100x the math of a tiny model on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, dataclass

import numpy as np

from ..loss import Row, per_response_token, per_token


def build_model(config, tokenizer, seed: int):
    """The policy model: ms_models tiny_config(arch, **overrides) with the task tokenizer's vocabulary
    and special ids (so a config.json written from it tells vLLM the right </s>), or
    from_pretrained(model_path)."""
    import ms_models

    from ..errors import RLHFError

    vocab_size = tokenizer.vocab_size
    if config.model_path:
        model = ms_models.from_pretrained(config.model_path)
        if model.config.vocab_size < vocab_size:
            raise RLHFError(f"model vocab_size {model.config.vocab_size} < the task tokenizer's {vocab_size}")
        return model
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    params = {**ids, **config.model}
    arch = params.pop("arch", "llama")
    try:
        model_config = ms_models.tiny_config(arch, vocab_size=vocab_size, **params)
    except (TypeError, ms_models.ModelError) as exc:
        raise RLHFError(f"bad model config {config.model}: {exc}") from None
    model = ms_models.from_config(model_config, seed=seed)
    return model


@dataclass
class LossStats:
    """Sums of the GRPO loss terms over micro-batches (and, once all-reduced, over ranks)."""

    loss: float = 0.0
    """sum(w * (pg + beta * kl)): what the gradient is of."""
    pg: float | None = 0.0
    """sum(w * pg), the clipped policy-gradient term (None: not computed, as under pipeline parallelism)."""
    kl: float | None = 0.0
    """sum(w * kl), the k3 estimate of KL to the reference (None: not computed)."""
    clipped: float | None = 0.0
    """Loss tokens whose PPO ratio was clipped (None: not counted)."""

    def __add__(self, other: LossStats) -> LossStats:
        add = lambda a, b: None if a is None or b is None else a + b  # noqa: E731
        return LossStats(self.loss + other.loss, add(self.pg, other.pg), add(self.kl, other.kl),
                         add(self.clipped, other.clipped))  # fmt: skip

    def to_array(self) -> np.ndarray:
        """[loss, pg, kl, clipped] as float64 (NaN for None), for a collective."""
        return np.array([np.nan if v is None else v for v in astuple(self)], np.float64)

    @classmethod
    def from_array(cls, values: np.ndarray) -> LossStats:
        return cls(*(None if np.isnan(v) else float(v) for v in values))


def grpo_loss_fn(eps: float, beta: float):
    """The GRPO loss as a function of [B, W] target log-probs `logp`, token weights, per-token
    advantages and old/reference log-probs -> (sum(w * (pg + beta * kl)), (sum(w * pg),
    sum(w * kl), clipped tokens)): the clipped PPO ratio term and the k3 KL estimate, positions of
    weight 0 contributing nothing. Traceable by mindspore.jit (a closure over its constants)."""
    import mindspore as ms
    from mindspore import ops

    eps, beta = float(eps), float(beta)

    def grpo_loss(logp, weights, adv, old, ref):
        on = weights > 0
        ratio = ops.exp(ops.where(on, logp - old, ops.zeros_like(logp)))
        unclipped, clipped = ratio * adv, ops.clamp(ratio, 1 - eps, 1 + eps) * adv
        pg = -ops.minimum(unclipped, clipped)
        diff = ops.where(on, ref - logp, ops.zeros_like(logp))
        kl = ops.exp(diff) - diff - 1
        total = ((pg + beta * kl) * weights).sum()
        clip_count = ops.logical_and(on, unclipped > clipped).astype(ms.float32).sum()
        return total, ((pg * weights).sum(), (kl * weights).sum(), clip_count)

    return grpo_loss


class PolicyFunctions:
    """Log-probs and the GRPO loss with its gradients for one model."""

    def __init__(self, model, clip_eps: float, kl_coef: float, jit: bool):
        import mindspore as ms
        from mindspore import ops

        self.model = model
        self.params = model.trainable_params()
        grpo_loss = grpo_loss_fn(clip_eps, kl_coef)

        def logprobs(ids, positions, segments, targets):
            logits = model(ids, positions, segments)
            logp = ops.log_softmax(logits, -1)
            return ops.gather_elements(logp, -1, targets.expand_dims(-1)).squeeze(-1)

        def loss(ids, positions, segments, targets, weights, adv, old, ref):
            return grpo_loss(logprobs(ids, positions, segments, targets), weights, adv, old, ref)

        self._logprobs = logprobs
        self._grad = ms.value_and_grad(loss, None, self.params, has_aux=True)
        if jit:
            self._logprobs = ms.jit(logprobs)
            self._grad = ms.jit(self._grad)

    @staticmethod
    def tensors(rows: Sequence[Row]) -> tuple:
        """ids, positions, segment ids and targets of equal-width rows as [B, W] tensors."""
        import mindspore as ms

        stack = lambda name: ms.Tensor(np.stack([getattr(r, name) for r in rows]))  # noqa: E731
        return stack("input_ids"), stack("positions"), stack("segment_ids"), stack("targets")

    def logprobs(self, rows: Sequence[Row]) -> np.ndarray:
        """[B, W] log-prob of every row's target tokens (only loss positions are meaningful)."""
        return self._logprobs(*self.tensors(rows)).asnumpy()

    def loss_and_grads(self, rows, weights, adv, old, ref):
        """The micro-batch's LossStats and the gradients as numpy arrays, for rows
        with per-row arrays: `weights` [B, W] token weights, `adv` per-sample advantages, and
        `old`/`ref` [B, W] row-aligned log-probs."""
        import mindspore as ms

        arrays = [
            np.stack(weights).astype(np.float32),
            np.stack([per_token(r, adv) for r in rows]),
            np.stack(old).astype(np.float32),
            np.stack(ref).astype(np.float32),
        ]
        (total, aux), grads = self._grad(*self.tensors(rows), *(ms.Tensor(a) for a in arrays))
        # gradients first, the embedding's (the end of the backward) leading: a compiled call
        # returns before its graph ran, and reading an output computed early (the loss) first
        # busy-waits the Python thread on the kernels' core (docs/mindspore-cpu.md, section 15)
        grads = [g.asnumpy() for g in grads]
        return LossStats(float(total.asnumpy()), *(float(a.asnumpy()) for a in aux)), grads


def row_weights(row: Row, sample_weight: np.ndarray) -> np.ndarray:
    """Per-token loss weights of a row from per-sample weights (0 off the loss positions)."""
    return per_token(row, sample_weight)


def response_values(row: Row, per_sample: Sequence[np.ndarray]) -> np.ndarray:
    """Row-aligned per-response-token values (e.g. rollout log-probs)."""
    return per_response_token(row, per_sample)
