"""Stage 2: probe one step of the pipelined run against the single-process reference (ms-probe).

The reference trains the unsplit model in one process for one step on the same first batch
(the mean of the microbatches' losses, one ``nn.Adam`` step). ms-probe then dumps one training
step -- the forward and backward of every module and the parameter gradients, as real tensors --
of the model holding the pipeline's weights after its first step and of the model holding the
reference's, on the second batch, and compares the two dumps module by module. Any difference the
pipelined step made (a gradient lost at the V's turn, a microbatch counted twice, a recompute
that changed a number) shows up as the first diverging module.

Why not dump inside the pipelined step itself: ms-pipeline's B and W passes re-run each stage's
forward (and recompute re-runs layers once more), so its modules are called 3-5 times per
microbatch where the reference calls them once, and dumps align by call order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import TEXT, StageResult, batches, setup_mindspore, timed, tokenize

from stages.pretrain import PretrainConfig


@dataclass(frozen=True)
class ProbeConfig:
    """How the probe compares."""

    tolerance: float = 1e-4
    """Largest absolute difference of any dumped tensor that counts as no divergence."""


def _loss_fn(model, ids, labels):
    from mindspore import ops

    logits = model(ids)
    return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _stack(step_batches):
    """The step's microbatches as one batch: the mean loss over it is the mean of the microbatch
    losses, since every microbatch has the same number of tokens."""
    import mindspore as ms

    ids = np.concatenate([x for x, _ in step_batches])
    labels = np.concatenate([y for _, y in step_batches])
    return ms.Tensor(ids), ms.Tensor(labels)


def _dump(model, ids, labels, path: Path) -> None:
    import mindspore as ms

    from ms_probe import PrecisionDebugger

    debugger = PrecisionDebugger(dump_path=str(path), task="tensor", level="L0")
    grad_fn = ms.value_and_grad(lambda i, y: _loss_fn(model, i, y), None, model.trainable_params())
    with debugger.dump_step(model):
        loss, _ = grad_fn(ids, labels)
        loss.asnumpy()


def run(config: ProbeConfig, pretrain: PretrainConfig, work: Path) -> StageResult:
    import mindspore as ms
    from safetensors.numpy import load_file

    import ms_models
    from ms_probe import compare_dirs, write_results

    result = StageResult("probe")
    with timed(result):
        setup_mindspore(1)
        init_dir = work / "init"
        tokens = tokenize(init_dir, TEXT)
        data = batches(tokens, 2, pretrain.microbatches, pretrain.micro_batch, pretrain.seq, pretrain.data_seed)

        reference = ms_models.from_pretrained(init_dir)
        params = reference.trainable_params()
        optimizer = ms.nn.Adam(params, learning_rate=pretrain.lr)
        ids, labels = _stack(data[0])
        loss, grads = ms.value_and_grad(lambda i, y: _loss_fn(reference, i, y), None, params)(ids, labels)
        optimizer(grads)

        pipelined = ms_models.from_pretrained(init_dir)
        step1 = load_file(str(work / "pipeline_step1.safetensors"))
        by_name = {p.name: p for p in pipelined.get_parameters()}
        for name, array in step1.items():
            by_name[name].set_data(ms.Tensor(array))
        weight_err = max(
            float(np.abs(by_name[p.name].asnumpy() - p.asnumpy()).max()) for p in reference.get_parameters()
        )

        probe_dir = work / "probe"
        ids2, labels2 = _stack(data[1])
        _dump(pipelined, ids2, labels2, probe_dir / "pipeline")
        _dump(reference, ids2, labels2, probe_dir / "reference")
        run = compare_dirs(str(probe_dir / "pipeline"), str(probe_dir / "reference"))
        write_results(run, str(probe_dir / "compare"))
        summary = run.summary()
        rows = [row for rank in run.ranks for row in rank.rows]
        errors = [row.metrics.get("MaxAbsErr") for row in rows]
        errors = [float(e) for e in errors if isinstance(e, (int, float))]
        max_err = max(errors) if errors else float("nan")
        worst = max(rows, key=lambda r: float(r.metrics.get("MaxAbsErr") or 0.0)) if rows else None

        result.check(
            "reference loss of step 1 equals the pipeline's",
            abs(float(loss.asnumpy()) - _pipeline_first_loss(work)) < 1e-5,
            f"reference {float(loss.asnumpy()):.6f}, pipeline {_pipeline_first_loss(work):.6f}",
        )
        result.check(
            "ms-probe finds no diverging module", summary["first_divergence"] is None,
            f"first divergence: {summary['first_divergence']} {summary['first_divergence_reason']}".strip(),
        )  # fmt: skip
        result.check(
            "every compared tensor within tolerance",
            bool(errors) and max_err <= config.tolerance,
            f"{len(errors)} tensors compared, max abs error {max_err:.2e} (tolerance {config.tolerance:g})",
        )
        result.numbers = {
            "aligned_items": summary["aligned_items"],
            "compared_tensors": len(errors),
            "max_abs_err": max_err,
            "worst_item": f"{worst.item} {worst.key}" if worst else "",
            "weights_max_abs_diff_after_step_1": weight_err,
            "first_divergence": summary["first_divergence"],
            "report": str(probe_dir / "compare" / "report.html"),
            "rows": [
                {"item": r.item, "key": r.key, "result": r.result, "MaxAbsErr": r.metrics.get("MaxAbsErr")}
                for r in rows
            ],
        }
    return result


def _pipeline_first_loss(work: Path) -> float:
    import json

    return float(json.loads((work / "pretrain.json").read_text())["numbers"]["first_loss"])
