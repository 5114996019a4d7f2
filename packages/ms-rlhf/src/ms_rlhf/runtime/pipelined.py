"""The actor under pipeline parallelism: ms-pipeline's runtime over the model's blocks, the GRPO
loss in the last block.

The model is cut into ``ms_models.pipeline_blocks`` (embedding, each decoder layer, head), spread
as evenly as they go over the schedule's stages (ZeroBubbleV by default: two stages per rank in a
V, so rank 0 holds the embedding and the head), and each rank keeps only its stages' weights:
master weights, Adam state and checkpoint shards included (``layouts``: every parameter on the
rank that owns it). The head block maps (hidden, labels) to the micro-batch's GRPO loss, labels
being the row-aligned (targets, token weights, advantages, old and reference log-probs). The
runtime seeds each micro-batch's loss with 1/m; the head multiplies its loss by m, so the step's
gradient is the plain sum over micro-batches, as the single-process trainer's is.

Pipeline blocks take positions 0..S-1 and a causal mask over the whole row, so the rows are padded
samples, one per row (``packing=False``); old and reference log-probs come from the whole rollout
and reference models on every rank (the same weights as the policy's before the update).
"""

from __future__ import annotations

import re

import numpy as np

from ..errors import RLHFError
from ..loss import per_token
from .policy import grpo_loss_fn

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def block_counts(blocks: int, stages: int) -> list[int]:
    """Blocks per stage, as even as they go (the first stages take the remainder)."""
    if blocks < stages:
        raise RLHFError(f"the model cuts into {blocks} pipeline blocks, fewer than the schedule's {stages} stages")
    return [blocks // stages + (1 if s < blocks % stages else 0) for s in range(stages)]


def build_schedule(name: str, ranks: int, microbatches: int):
    """ms-pipeline's schedule `name` for `ranks` ranks; a name or size it refuses is an RLHFError."""
    import ms_pipeline as mp

    try:
        return mp.build(name, ranks, microbatches)
    except mp.ScheduleError as exc:
        raise RLHFError(
            f"config parallel.pipeline_schedule={name!r} on {ranks} ranks, {microbatches} micro-batches: {exc}"
        ) from None


def owners(names, num_layers: int, schedule) -> dict[str, int]:
    """{parameter name: the rank whose stage holds it} when the blocks [embedding, layer 0, ...,
    layer L-1, head] are cut evenly over `schedule`'s stages."""
    counts = block_counts(num_layers + 2, schedule.num_stages)
    stage_of = [s for s, c in enumerate(counts) for _ in range(c)]
    out = {}
    for name in names:
        layer = _LAYER.match(name)
        block = 0 if "embed_tokens" in name else int(layer.group(1)) + 1 if layer else num_layers + 1
        out[name] = schedule.stage_to_rank[stage_of[block]]
    return out


def layouts(shapes, owner: dict[str, int]):
    """{name: ms_reshard.ParamSpec}: every parameter whole on the rank that owns it."""
    from ms_layout import Layout
    from ms_reshard import ParamSpec

    return {
        name: ParamSpec(Layout((1,), ("dp",), tuple(() for _ in shape), (owner[name],)), tuple(shape), "float32")
        for name, shape in shapes.items()
    }


class PipelinedActor:
    """One rank's stages of the policy, run by ms-pipeline's PipelineRuntime."""

    def __init__(self, model, group, microbatches: int, rows: int, width: int, config):
        import mindspore as ms
        from mindspore import nn, ops

        import ms_models
        import ms_pipeline as mp

        grpo_loss = grpo_loss_fn(config.loss.clip_eps, config.loss.kl_coef)
        scale = float(microbatches)

        class GRPOHead(nn.Cell):
            """(hidden, (targets, weights, adv, old, ref)) -> m x the micro-batch's GRPO loss."""

            def __init__(self, head):
                super().__init__()
                self.norm, self.lm_head = head.norm, head.lm_head

            def construct(self, x, labels):
                targets, weights, adv, old, ref = labels
                logp = ops.log_softmax(self.lm_head(self.norm(x)), -1)
                logp = ops.gather_elements(logp, -1, targets.expand_dims(-1)).squeeze(-1)
                return grpo_loss(logp, weights, adv, old, ref)[0] * scale

        self.schedule = build_schedule(config.parallel.pipeline_schedule, group.size, microbatches)
        blocks = ms_models.pipeline_blocks(model)
        names = {id(p): p.name for b in blocks for p in b.get_parameters()}
        blocks[-1] = GRPOHead(blocks[-1])
        for p in blocks[-1].get_parameters():  # wrapping renamed them: the HF names back
            p.name = names[id(p)]
        placement = mp.LayerPlacement.from_counts(block_counts(len(blocks), self.schedule.num_stages))
        staged = mp.runtime.split_blocks(blocks, placement)
        mine = {s: staged[s] for s in self.schedule.stages_of(group.rank)}
        hidden = model.config.hidden_size
        self.runtime = mp.runtime.PipelineRuntime(
            self.schedule, mine, group, activation_shape=(rows, width, hidden), jit=config.jit
        )
        self.names = [p.name for p in self.runtime.params]
        self._ms = ms

    def loss_and_grads(self, micro_batches, weights, adv, olds, refs) -> tuple[float, dict[str, np.ndarray]]:
        """The sum of the micro-batches' GRPO losses (the same on every rank) and this rank's
        gradients by parameter name, for one mini-batch: ``weights[i]`` [B, W] token weights of
        micro-batch i, `adv` per-sample advantages, ``olds[i]``/``refs[i]`` its log-probs."""
        ms = self._ms
        inputs, labels = [], []
        for mb, w, old, ref in zip(micro_batches, weights, olds, refs):
            rows = mb.rows
            inputs.append(ms.Tensor(np.stack([r.input_ids for r in rows])))
            arrays = (
                np.stack([r.targets for r in rows]),
                np.stack(w).astype(np.float32),
                np.stack([per_token(r, adv) for r in rows]),
                np.asarray(old, np.float32),
                np.asarray(ref, np.float32),
            )
            labels.append(tuple(ms.Tensor(a) for a in arrays))
        self.runtime.zero_grads()
        result = self.runtime.step(inputs, labels)
        return result.loss, self.runtime.grads()
