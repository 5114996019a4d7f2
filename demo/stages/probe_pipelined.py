"""The probe stage's fifth comparison: step 1 of the pipelined run dumped by its own ranks.

The two pipeline ranks run step 1 again with ZeroBubbleV, from the weights the pretrain ranks
began it with, on the same batch, with ms-probe's ``PrecisionDebugger`` as the runtime's probe:
every F, B and W names its stage, microbatch and pass, so each rank's dump holds each module's
forward and backward once per microbatch, and the parameter gradients, under the pass that made
them. The reference is the unsplit model stepping through the same microbatches one by one (each
loss scaled by 1/M, as the pipeline's), so that module call k is microbatch k on both sides. The
ranks' dumps merge into one (``compare_dirs(merge_target_ranks=True)``) and compare against it;
the first diverging module is named with the stage, microbatch and pass that ran it.

What differs from the compiled step that trained: the ranks run eagerly (ms-probe's hooks run
where modules are called as Cells: in PyNative), B and W re-run the stage's forward inside
``ms.grad`` instead of the explicit passes (``dw="recompute"``; the probe leaves the replays out),
and no layer is recomputed. The schedule, the placement, the transfers between the ranks, the
weights and the batch are the trained step's.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from common import TEXT, batches, setup_mindspore, tokenize

from stages.pretrain import PretrainConfig, _build, _config

MODULES = ["model.embed_tokens", "model.layers.", "model.norm", "lm_head"]
"""What is dumped: every module of the model (the pipeline's blocks hold these)."""


def _debugger(path: Path):
    from ms_probe import PrecisionDebugger

    return PrecisionDebugger(dump_path=str(path), task="tensor", level="L0", list=MODULES)


def _step_one(config: PretrainConfig, init_dir: str):
    (step,) = batches(
        tokenize(init_dir, TEXT), 1, config.microbatches, config.micro_batch, config.seq, config.data_seed
    )
    return step


def _rank(group, config_data: dict, init_dir: str, began: str, root: str) -> str:
    """One pipeline rank re-running step 1 under the probe (module-level: spawned processes import it)."""
    import mindspore as ms
    from safetensors.numpy import load_file

    import ms_models

    config = _config(config_data)
    setup_mindspore(1)
    model = ms_models.from_pretrained(init_dir)
    weights = {p.name: p for p in model.get_parameters()}
    for key, array in load_file(began).items():
        if key.startswith("began/"):
            weights[key.removeprefix("began/")].set_data(ms.Tensor(array))
    debugger = _debugger(Path(root))
    runtime, _, _ = _build(group, config, init_dir, probe=debugger, model=model)
    data = _step_one(config, init_dir)
    debugger.start(model)
    runtime.step([ms.Tensor(x) for x, _ in data], [ms.Tensor(y) for _, y in data])
    folder = debugger.stop() or str(Path(root) / "step0" / f"rank{group.rank}")
    debugger.close()
    return folder


def _reference(config: PretrainConfig, init_dir: str, root: Path) -> None:
    """The unsplit model through step 1's microbatches one by one, dumped."""
    import mindspore as ms
    from mindspore import ops

    import ms_models

    net = ms_models.from_pretrained(init_dir)
    data = _step_one(config, init_dir)
    debugger = _debugger(root)

    def loss_of(ids, labels):
        logits = net(ids)
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)) / len(data)

    grad_fn = ms.value_and_grad(loss_of, None, net.trainable_params())
    debugger.start(net)
    for ids, labels in data:
        grad_fn(ms.Tensor(ids), ms.Tensor(labels))[0].asnumpy()
    debugger.stop()
    debugger.close()


def compare_pipelined_step(config: PretrainConfig, init_dir: str, work: Path) -> dict:
    """Dump step 1 on the pipeline ranks and in one process, compare; ms-probe's run summary
    (first_divergence, first_divergence_where, counts) and where the report went."""
    from ms_layout.comm import run_local
    from ms_probe import compare_dirs, merge_ranks, write_results
    from ms_probe.reader import load_rank

    root = work / "probe" / "pipelined"
    run_local(
        _rank, config.ranks, backend="gloo", timeout=config.timeout, env={"OMP_NUM_THREADS": "1"},
        args=(asdict(config), init_dir, str(work / "pipeline_step1.safetensors"), str(root / "ranks")),
    )  # fmt: skip
    _reference(config, init_dir, root / "reference")
    run = compare_dirs(str(root / "ranks"), str(root / "reference"), merge_target_ranks=True)
    write_results(run, str(root / "compare"))
    summary = run.summary()
    (merged,) = run.ranks
    dumped = merge_ranks([load_rank(f) for f in sorted((root / "ranks" / "step0").glob("rank*"))])
    summary["passes"] = sorted({item.where["pass"] for item in dumped.items.values() if item.where})
    summary["compared_modules"] = len(merged.modules)
    summary["report"] = str(root / "compare" / "report.html")
    return summary
