"""ms-pipeline x ms-probe: ms-probe dumps one ZeroBubbleV step of the tiny DeepSeek-V3 on each of
2 gloo ranks, and the single-process reference step; ``compare_rank`` of each rank's dump against
the reference finds no divergence. With one weight of stage 1 (rank 1, decoder layer 1) perturbed,
it names that layer's projection as the first diverging module on rank 1; on rank 0 it blames no
module: the embedding and layer 0 (before the perturbed stage) pass, and the final norm and LM head
(after it) are flagged as inheriting the divergence from their inputs.

What is dumped: the forward of every ms-models module the rank runs (the debugger is attached to
the whole model, so module paths equal the reference's). It records only during the runtime's F
passes (a PipelineRuntime subclass starts and stops it around ``run_compute``): ms-pipeline's B and
W passes re-run a stage's forward inside ``ms.grad``, and those replays would shift the per-module
call counters ms-probe aligns by. A stage runs its F passes in microbatch order, so forward call k
of a layer is microbatch k on both sides. Gradients are compared by the ms-models x ms-pipeline
pair; here the items are forward only (``data_mode=["forward"]`` on both sides)."""

from __future__ import annotations

from pathlib import Path

import _tiny
import pytest

pytest.importorskip("mindspore")
pytest.importorskip("torch")
pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch, pytest.mark.timeout(600)]

PERTURBED = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # stage 1, on rank 1 under ZBV
# the model's modules; model.rotary_emb is left out: the pipeline's layer blocks each compute the
# RoPE angles (one call per layer), the whole model once per forward, so its call counts differ
MODULES = ["model.embed_tokens", "model.layers.", "model.norm", "lm_head"]


def _debugger(path: Path):
    from ms_probe import PrecisionDebugger

    return PrecisionDebugger(dump_path=str(path), task="statistics", level="L0", data_mode=["forward"], list=MODULES)


def _dump(group, root: str, perturb: bool) -> str:
    import ms_pipeline as mp

    net = _tiny.model()
    if perturb and _tiny.owner_rank(PERTURBED) == group.rank:
        param = dict(net.parameters_and_names())[PERTURBED]
        param.set_data(param + 1e-2)
    debugger = _debugger(Path(root))

    class ProbedRuntime(mp.runtime.PipelineRuntime):
        def run_compute(self, part):
            forward = part.kind.value == "F"
            if forward:
                debugger.start(net)
            try:
                super().run_compute(part)
            finally:
                if forward:
                    debugger.stop()

    plan = _tiny.schedule(group.size)
    staged = mp.runtime.split_blocks(_tiny.blocks(net), mp.LayerPlacement.from_counts(list(_tiny.COUNTS)))
    mine = {s: staged[s] for s in plan.stages_of(group.rank)}
    runtime = ProbedRuntime(plan, mine, group, activation_shape=(_tiny.MB, _tiny.SEQ, net.config.hidden_size))
    runtime.step(*_tiny.data(net.config.vocab_size))
    folder = debugger.stop() or str(Path(root) / "step0" / f"rank{group.rank}")
    debugger.close()
    return folder


def _rank(group, root: str) -> tuple[str, str]:
    """The clean step, then the perturbed one, in one launch (one rank start-up instead of two)."""
    return _dump(group, str(Path(root) / "clean"), False), _dump(group, str(Path(root) / "bad"), True)


def _golden(path: Path) -> str:
    net = _tiny.model()
    debugger = _debugger(path)
    with debugger.dump_step(net):
        _tiny.reference_step(net, *_tiny.data(net.config.vocab_size))
    debugger.close()
    (folder,) = path.glob("step0/rank*")
    return str(folder)


def _compare(target: str, golden: str):
    from ms_probe import compare_rank, load_rank

    return compare_rank(load_rank(target), load_rank(golden))


def test_probe_finds_no_divergence_then_names_the_perturbed_module(run_ranks, tmp_path):
    golden = _golden(tmp_path / "golden")
    folders = run_ranks(_rank, nprocs=2, timeout=500, args=(str(tmp_path),), env={"OMP_NUM_THREADS": "1"})
    clean, bad = [f[0] for f in folders], [f[1] for f in folders]

    for rank, folder in enumerate(clean):
        assert folder.endswith(f"rank{rank}")
        result = _compare(folder, golden)
        counts = result.summary()
        matched = [m for m in result.modules if m.golden is not None]
        # every forward call of every module this rank ran met its reference call
        assert len(matched) == len(result.modules) > 0, counts
        assert result.first_divergence is None, (rank, result.first_divergence, result.first_divergence_reason)
        layers = {m.path.split(".")[2] for m in matched if m.path.startswith("model.layers.")}
        assert layers == ({"0"} if rank == 0 else {"1", "2", "3"})
        assert {m.result for m in matched} == {"pass"}, counts

    stage0, stage1 = (_compare(folder, golden) for folder in bad)
    first = stage1.first_divergence
    assert first is not None and first.startswith("Cell.model.layers.1.self_attn.kv_a_proj_with_mqa."), first
    assert first.endswith(".forward.0") and "weight" in stage1.first_divergence_reason
    assert stage0.first_divergence is None, stage0.first_divergence
    before = [m for m in stage0.modules if m.path.startswith(("model.embed_tokens", "model.layers.0"))]
    after = [m for m in stage0.modules if m.path.startswith(("model.norm", "lm_head"))]
    assert before and {m.result for m in before} == {"pass"}
    flagged = [m for m in after if m.result != "pass"]
    assert flagged and all("inherited" in m.reason for m in flagged), [(m.name, m.result, m.reason) for m in after]


# ---------------------------------------------------------------------------------------------
# The whole pipelined step dumped: forward and backward, every pass named (PipelineRuntime(probe=))

MICRO_PERTURBED = "model.layers.1.mlp.shared_experts.down_proj.weight"  # layer 1: stage 1, rank 1 under ZBV


def _full_debugger(path: Path):
    from ms_probe import PrecisionDebugger

    return PrecisionDebugger(dump_path=str(path), task="tensor", level="L0", list=MODULES)


def _pipelined_dump(group, root: str, perturb: bool) -> str:
    """One ZeroBubbleV step dumped by the runtime's probe; dw="recompute": B and W each re-run
    the stage's forward inside ``ms.grad`` (the replays the probe must leave out)."""
    net = _tiny.model()
    if perturb and _tiny.owner_rank(MICRO_PERTURBED) == group.rank:
        param = dict(net.parameters_and_names())[MICRO_PERTURBED]
        param.set_data(param * 1.01)
    debugger = _full_debugger(Path(root))
    runtime = _tiny.pipeline_runtime(group, net, dw="recompute", probe=debugger)
    debugger.start(net)
    runtime.step(*_tiny.data(net.config.vocab_size))
    folder = debugger.stop() or str(Path(root) / "step0" / f"rank{group.rank}")
    debugger.close()
    return folder


def _pipelined_rank(group, root: str) -> tuple[str, str]:
    root = Path(root)
    return _pipelined_dump(group, str(root / "clean"), False), _pipelined_dump(group, str(root / "bad"), True)


def _microbatch_golden(path: Path) -> Path:
    """The single-process step as a loop over the microbatches, each one's forward and backward
    (its loss scaled by 1/M, as the pipeline's), so that module call k is microbatch k."""
    import mindspore as ms
    from mindspore import ops

    net = _tiny.model()
    inputs, labels = _tiny.data(net.config.vocab_size)
    params = net.trainable_params()
    debugger = _full_debugger(path)

    def loss_of(ids, y):
        logits = net(ids)
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / len(inputs)

    grad_fn = ms.value_and_grad(loss_of, None, params)
    debugger.start(net)
    for ids, y in zip(inputs, labels):
        grad_fn(ids, y)[0].asnumpy()
    debugger.stop()
    debugger.close()
    return path


def test_the_pipelined_step_itself_compares_module_by_module(run_ranks, tmp_path):
    """ms-probe dumps the ZeroBubbleV step itself (B and W re-running the forward, both ranks), the
    ranks' dumps merge into one, and it compares with the single-process step's: every forward,
    backward and parameter gradient item passes; a 1 % scaled weight of stage 1 is named as the
    first divergence with its stage, microbatch and pass."""
    from ms_probe import compare_dirs

    golden = _microbatch_golden(tmp_path / "golden")
    folders = run_ranks(_pipelined_rank, nprocs=2, timeout=500, args=(str(tmp_path),), env={"OMP_NUM_THREADS": "1"})
    assert [Path(f[0]).name for f in folders] == ["rank0", "rank1"]

    clean = compare_dirs(str(tmp_path / "clean"), str(golden), merge_target_ranks=True)
    summary = clean.summary()
    assert summary["first_divergence"] is None, summary
    (rank,) = clean.ranks
    rows = {m.name: m for m in rank.modules}
    kinds = {name.rsplit(".", 2)[-2] if "parameters_grad" not in name else "parameters_grad" for name in rows}
    assert kinds == {"forward", "backward", "parameters_grad"}, kinds
    assert summary["target_only"] == summary["golden_only"] == 0, summary
    assert {m.result for m in rank.modules} == {"pass"}, [(m.name, m.result, m.reason) for m in rank.modules]
    # every microbatch of every decoder layer, forward and backward
    for layer in range(_tiny.LAYERS):
        for k in range(_tiny.M):
            for direction in ("forward", "backward"):
                prefix, suffix = f"Cell.model.layers.{layer}.", f".{direction}.{k}"
                assert any(n.startswith(prefix) and n.endswith(suffix) for n in rows), (prefix, suffix)

    bad = compare_dirs(str(tmp_path / "bad"), str(golden), merge_target_ranks=True).summary()
    first = bad["first_divergence"]
    assert first is not None and first.startswith("Cell.model.layers.1.mlp.shared_experts.down_proj."), bad
    assert first.endswith(".forward.0"), first
    assert bad["first_divergence_where"] == {"stage": 1, "microbatch": 0, "pass": "F"}, bad
