"""The tiny DeepSeek-V3-style model the pair tests share, cut into pipeline blocks.

Only public names of the packages are used. The model is ms-models' tiny DeepSeek-V3 (MLA with
low-rank q/kv and decoupled YaRN RoPE, 1 dense layer then DeepSeekMoE layers) with 4 decoder
layers and no MTP module (the pipeline trains the main model only). It is cut at the natural
seams into blocks -- the embedding, each decoder layer, and a head (final norm, LM head,
cross-entropy) -- and each layer block derives its RoPE angles and causal mask from the hidden
state's shape, so the only tensor that crosses stages is the hidden state [MB, SEQ, H].

ZeroBubbleV on 2 ranks has 4 stages (rank 0: stages 0 and 3, rank 1: stages 1 and 2); COUNTS puts
[embed + layer 0], [layers 1-2], [layer 3], [head] on them, so each rank holds decoder layers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MB, SEQ, M = 2, 6, 4  # microbatch size, sequence length, microbatches per step
LAYERS = 4
COUNTS = (2, 2, 1, 1)  # blocks per stage: embed+L0 | L1 L2 | L3 | head
SCHEDULE = "zbv"
# Pipelined vs single-process float32 results: the same ops grouped differently (per-stage ms.grad
# vs one graph, microbatch gradients summed in another order), so they agree to rounding relative to
# each tensor's own scale (see ms_layout.testing.assert_close). A length-n float32 sum computed in another
# order is off by up to ~n*u of its terms (u = 2**-24); the longest chain of sums behind a gradient
# here is the LM head's over the vocabulary (320), one over <= 128 per decoder layer (4 of them) and
# the step's 48 tokens (M * MB * SEQ): n ~ 320 + 4 * 128 + 48 < 1024. Measured: <= 1.5e-7 of the
# scale (gradient scales range from 2e-5 to 0.12, so the absolute 1e-5 this replaces allowed 40 %
# of the smallest and ~8e-5 of the largest).
RTOL = 1024 * 2.0**-24  # ~6.1e-5, for the loss and every gradient


def setup(device: str = "CPU") -> None:
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device(device)


def config(**overrides: Any):
    import ms_models

    return ms_models.tiny_config("deepseek_v3", num_hidden_layers=LAYERS, num_nextn_predict_layers=0, **overrides)


def model(seed: int = 0, device: str = "CPU"):
    """The tiny DeepSeek-V3 (same weights in every process for the same seed)."""
    import ms_models

    setup(device)
    return ms_models.from_config(config(), seed=seed)


def data(vocab: int, seed: int = 3) -> tuple[list, list]:
    """M microbatches of ids [MB, SEQ] and their next-token labels, as MindSpore tensors."""
    import mindspore as ms

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (M, MB, SEQ + 1)).astype(np.int32)
    return [ms.Tensor(x[:, :-1]) for x in ids], [ms.Tensor(x[:, 1:]) for x in ids]


def blocks(net) -> list:
    """embed, layer 0..LAYERS-1, head, as Cells whose parameters keep their HF names."""
    import ms_models

    return ms_models.pipeline_blocks(net)


def stage_layers(net, stage: int) -> list:
    """The decoder layers (ms_models layer Cells) that stage `stage` holds under COUNTS."""
    start = sum(COUNTS[:stage])
    return [net.model.layers[i - 1] for i in range(start, start + COUNTS[stage]) if 1 <= i <= LAYERS]


def schedule(num_ranks: int = 2):
    import ms_pipeline as mp

    return mp.build(SCHEDULE, num_ranks, M)


def owner_rank(name: str, num_ranks: int = 2) -> int:
    """The rank whose pipeline stage holds parameter `name` (HF name) under COUNTS and ZBV."""
    if name.startswith("model.embed_tokens."):
        block = 0
    elif name.startswith("model.layers."):
        block = 1 + int(name.split(".")[2])
    else:  # model.norm, lm_head
        block = LAYERS + 1
    bounds = np.cumsum(COUNTS)
    stage = int(np.searchsorted(bounds, block, side="right"))
    return schedule(num_ranks).stage_to_rank[stage]


def pipeline_runtime(group, net, optimizer=None, **kwargs):
    """A ZeroBubbleV PipelineRuntime over this rank's stages of `net`; `optimizer(params)` builds
    the optimizer over this rank's trainable parameters."""
    import ms_pipeline as mp

    placement = mp.LayerPlacement.from_counts(list(COUNTS))
    staged = mp.runtime.split_blocks(blocks(net), placement)
    plan = schedule(group.size)
    mine = {s: staged[s] for s in plan.stages_of(group.rank)}
    if optimizer is not None:
        params = {id(p): p for s in mine for b in mine[s] for p in b.trainable_params()}
        kwargs["optimizer"] = optimizer(list(params.values()))
    return mp.runtime.PipelineRuntime(plan, mine, group, activation_shape=(MB, SEQ, net.config.hidden_size), **kwargs)


def reference_step(net, inputs, labels) -> tuple[float, dict[str, np.ndarray]]:
    """Single-process value_and_grad of the mean microbatch loss: (loss, {HF name: grad})."""
    import mindspore as ms
    from mindspore import ops

    params = net.trainable_params()

    def mean_loss():
        total = ms.Tensor(0.0)
        for ids, y in zip(inputs, labels):
            logits = net(ids)
            total = total + ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        return total / len(inputs)

    loss, grads = ms.value_and_grad(mean_loss, None, params)()
    return float(loss.asnumpy()), {p.name: g.asnumpy() for p, g in zip(params, grads)}
