"""Stage 2: probe one step of the pipelined run against the single-process reference (ms-probe).

The reference trains the unsplit model in one process for one step on the same first batch
(the mean of the microbatches' losses, one ``nn.Adam`` step). Four comparisons follow, each
naming where a difference starts:

1. step 1 as it began: ms-probe dumps one training step (the forward and backward of every
   module and the parameter gradients, as real tensors) of the model holding the weights the
   pipeline ranks started step 1 with, and of the reference, on the first batch: a stage that
   trained a wrong weight shows up as the first diverging module.
2. step 1's gradients: the gradients the pipelined step accumulated (every microbatch, every
   stage, B and W) against the reference's, parameter by parameter: a gradient lost at the V's
   turn, a microbatch dropped or counted twice, a recompute that changed a number.
3. step 1's update: Adam on the pipeline's own gradients from the weights it began with must
   give the weights its ranks ended with: an optimizer step that went wrong (a parameter left
   out, another learning rate, a stale gradient).
4. step 2: the same dump of the models holding the weights after step 1 (the pipeline's and the
   reference's), on the second batch, judged by ms-probe's rules.
5. step 1 on the pipeline ranks: the two ranks run step 1 again under ms-probe with the weights
   they began it with (stages/probe_pipelined.py); their dumps, every module per microbatch and
   pass, merge and compare against the unsplit model stepping through the same microbatches; a
   divergence is named with its stage, microbatch and pass (F, B, W).

Comparisons 1 and 2 are judged twice: by ms-probe's own rules (cosine, error ratios, per-module
checkers) and by a bound from float32 rounding, relative to each tensor's scale
(demo/tolerance.py): the two runs did the same arithmetic in another order, so no tensor may
differ by more than n * u of its magnitude. An absolute tolerance would not hold across CPUs and thread counts.

Why comparison 5 re-runs step 1 instead of dumping the step that trained: that step runs
compiled (each stage's F, B and W are ``mindspore.jit`` graphs over the blocks' explicit passes),
where no module is called as a Cell and no dump hook runs. The re-run keeps the schedule, the
ranks, their transfers, the weights and the batch, and runs eagerly; comparisons 2 and 3 check
the compiled step's own gradients and update.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import TEXT, StageResult, batches, setup_mindspore, timed, tokenize
from tolerance import UNIT_ROUNDOFF, Closeness, Rtol, closeness, float32_rtol, judge

from stages.pretrain import PretrainConfig
from stages.probe_pipelined import compare_pipelined_step


@dataclass(frozen=True)
class ProbeConfig:
    """How the probe compares."""

    rtol_scale: float = 1.0
    """Multiplies the float32 rounding bound (tolerance.float32_rtol); 1 is the bound itself."""


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


def _load(init_dir: Path, arrays: dict[str, np.ndarray]):
    """The model from the initial checkpoint with `arrays` (by parameter name) loaded over it."""
    import mindspore as ms

    import ms_models

    model = ms_models.from_pretrained(init_dir)
    by_name = {p.name: p for p in model.get_parameters()}
    for name, array in arrays.items():
        by_name[name].set_data(ms.Tensor(array))
    return model


def _compare(target, golden, ids, labels, path: Path, rtol: Rtol) -> tuple:
    """Dump one step of both models, compare with ms-probe; (its summary, within rtol, the
    check's text, the worst tensor, every tensor's closeness)."""
    from ms_probe import compare_dirs, write_results

    _dump(target, ids, labels, path / "pipeline")
    _dump(golden, ids, labels, path / "reference")
    run = compare_dirs(str(path / "pipeline"), str(path / "reference"))
    write_results(run, str(path / "compare"))
    values = closeness([row for rank in run.ranks for row in rank.rows])
    return (run.summary(), *judge(values, rtol), values)


def _param_closeness(name: str, what: str, a: np.ndarray, b: np.ndarray) -> Closeness:
    """One parameter's arrays compared: item = its module path, key = its own name and `what`."""
    module, leaf = name.rsplit(".", 1)
    scale = max(float(np.abs(a).max()), float(np.abs(b).max()))
    return Closeness(module, f"{leaf} {what}", float(np.abs(a - b).max()), scale)


def _divergence(summary: dict) -> str:
    return f"first divergence: {summary['first_divergence']} {summary['first_divergence_reason']}".strip()


def run(config: ProbeConfig, pretrain: PretrainConfig, work: Path) -> StageResult:
    import mindspore as ms
    from safetensors.numpy import load_file

    import ms_models

    result = StageResult("probe")
    with timed(result):
        setup_mindspore(1)
        init_dir = work / "init"
        tokens = tokenize(init_dir, TEXT)
        data = batches(tokens, 2, pretrain.microbatches, pretrain.micro_batch, pretrain.seq, pretrain.data_seed)
        saved = load_file(str(work / "pipeline_step1.safetensors"))
        began = {k.removeprefix("began/"): v for k, v in saved.items() if k.startswith("began/")}
        pipe_grads = {k.removeprefix("grad/"): v for k, v in saved.items() if k.startswith("grad/")}
        after = {k.removeprefix("after/"): v for k, v in saved.items() if k.startswith("after/")}

        reference = ms_models.from_pretrained(init_dir)
        rtol = _rtol(config, pretrain, reference.config)
        probe_dir = work / "probe"
        ids, labels = _stack(data[0])

        # 1. step 1 as it began: the pipeline's starting weights against the initial checkpoint's
        began_model = _load(init_dir, began)
        s1, close1, text1, _, _ = _compare(began_model, reference, ids, labels, probe_dir / "step1", rtol)
        result.check("step 1: ms-probe finds no diverging module", s1["first_divergence"] is None, _divergence(s1))
        result.check("step 1: every compared tensor within float32 rounding of its scale", close1, text1)

        # the reference step
        params = reference.trainable_params()
        optimizer = ms.nn.Adam(params, learning_rate=pretrain.lr)
        loss, grads = ms.value_and_grad(lambda i, y: _loss_fn(reference, i, y), None, params)(ids, labels)
        optimizer(grads)
        ref_loss, pipe_loss = float(loss.asnumpy()), _pipeline_first_loss(work)
        result.check(
            "reference loss of step 1 equals the pipeline's",
            abs(ref_loss - pipe_loss) <= rtol.value * abs(ref_loss),
            f"reference {ref_loss:.6f}, pipeline {pipe_loss:.6f}, relative difference "
            f"{abs(ref_loss - pipe_loss) / abs(ref_loss):.1e} (tolerance {rtol.value:.1e})",
        )

        # 2. the gradients the pipelined step accumulated, parameter by parameter (model order)
        grad_values = [
            _param_closeness(p.name, "gradient", pipe_grads[p.name], g.asnumpy()) for p, g in zip(params, grads)
        ]
        close_g, text_g, _ = judge(grad_values, rtol)
        result.check("step 1: every gradient within float32 rounding of its scale", close_g, text_g)

        # 3. step 1's optimizer update: Adam on the pipeline's own gradients, from the weights it
        # began with, must give the weights it ended with (the same arithmetic on the same inputs)
        replay_params = began_model.trainable_params()  # its dump is done: it can take the update
        ms.nn.Adam(replay_params, learning_rate=pretrain.lr)(
            tuple(ms.Tensor(pipe_grads[p.name]) for p in replay_params)
        )
        update_values = [
            _param_closeness(p.name, "after the update", p.asnumpy(), after[p.name]) for p in replay_params
        ]
        close_u, text_u, _ = judge(update_values, _ADAM_RTOL)
        result.check("step 1: the pipeline's optimizer update equals Adam on its gradients", close_u, text_u)

        # 4. step 2 on the weights after step 1, judged by ms-probe's rules. Not by the float32
        # bound: Adam's first update lr * g / (|g| + eps) turns a rounding-sized change of a
        # gradient element within ~eps of zero into a change of up to ~lr / 4 of its weight, so
        # the two models' weights legitimately differ by more than n * u of their scale there.
        pipelined = _load(init_dir, after)
        weight_err = max(
            float(np.abs(p.asnumpy() - after[p.name]).max()) for p in reference.get_parameters() if p.name in after
        )
        ids2, labels2 = _stack(data[1])
        s2, _, _, worst, values = _compare(pipelined, reference, ids2, labels2, probe_dir / "step2", rtol)
        result.check("step 2: ms-probe finds no diverging module", s2["first_divergence"] is None, _divergence(s2))

        # 5. step 1 dumped on the pipeline ranks themselves, merged, against the microbatch loop
        s5 = compare_pipelined_step(pretrain, str(init_dir), work)
        where = s5["first_divergence_where"] or {}
        result.check(
            "step 1 on the pipeline ranks: ms-probe finds no diverging module",
            s5["first_divergence"] is None,
            _divergence(s5) + (f" in stage {where.get('stage')}, microbatch {where.get('microbatch')}, "
                               f"pass {where.get('pass')}" if where else "")
            + f"; {s5['compared_modules']} modules x microbatches compared, passes {s5['passes']}",
        )  # fmt: skip

        result.numbers = {
            "aligned_items": s2["aligned_items"],
            "compared_tensors": len(values),
            "max_abs_err": max((c.max_abs_err for c in values), default=float("nan")),
            "max_relative_err": worst.relative if worst else float("nan"),
            "max_relative_grad_err": max((c.relative for c in grad_values), default=float("nan")),
            "max_relative_update_err": max((c.relative for c in update_values), default=float("nan")),
            "update_rtol": _ADAM_RTOL.value,
            "rtol": rtol.value,
            "rtol_derivation": rtol.derivation,
            "worst_item": f"{worst.item} {worst.key}" if worst else "",
            "weights_max_abs_diff_after_step_1": weight_err,
            "first_divergence_step1": s1["first_divergence"],
            "first_divergence": s2["first_divergence"],
            "report": str(probe_dir / "step2" / "compare" / "report.html"),
            "pipelined_first_divergence": s5["first_divergence"],
            "pipelined_first_divergence_where": s5["first_divergence_where"],
            "pipelined_compared_modules": s5["compared_modules"],
            "pipelined_passes": s5["passes"],
            "pipelined_report": s5["report"],
            "rows": [
                {"item": c.item, "key": c.key, "MaxAbsErr": c.max_abs_err, "scale": c.scale, "relative": c.relative}
                for c in values
            ],
        }
    return result


_ADAM_RTOL = Rtol(16 * UNIT_ROUNDOFF, 16, "n * u = 16 * 2^-24 (the roundings of one element's Adam update)")
"""Two runs of Adam's elementwise update on the same weights and gradients: a few roundings apart."""


def _rtol(config: ProbeConfig, pretrain: PretrainConfig, model_config) -> Rtol:
    """The float32 bound for this step: its tokens, its blocks (decoder layers and the head) and
    the widest reduction among hidden, intermediate, vocabulary and sequence sizes."""
    widest = max(model_config.hidden_size, model_config.intermediate_size, model_config.vocab_size, pretrain.seq)
    tokens = pretrain.microbatches * pretrain.micro_batch * pretrain.seq
    bound = float32_rtol(tokens=tokens, layers=model_config.num_hidden_layers + 1, widest=widest)
    return Rtol(bound.value * config.rtol_scale, bound.roundings, bound.derivation)


def _pipeline_first_loss(work: Path) -> float:
    import json

    return float(json.loads((work / "pretrain.json").read_text())["numbers"]["first_loss"])
