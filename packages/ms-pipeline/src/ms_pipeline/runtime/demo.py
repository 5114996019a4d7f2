"""Run a schedule on local CPU ranks with the toy model: ``ms-pipeline run`` and the benchmark.

:func:`run_toy` spawns one process per rank (``ms_layout.comm.run_local``, gloo), builds the same
toy model on each, keeps the blocks of the rank's stages (layers spread evenly over the stages),
and runs training steps. :func:`run_demo` adds the single-process reference and reports whether
the pipelined loss and gradients match it.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..ir import Schedule
from ..placement import LayerPlacement
from ..simulate import Bubbles
from ..trace import check_trace, replay


@dataclass(frozen=True)
class ToyConfig:
    """Size of the toy model and its data, and how each rank runs."""

    vocab: int = 64
    """Vocabulary size."""
    d: int = 32
    """Hidden size."""
    layers: int = 0
    """(attention, MLP) pairs; 0: just enough for one block per stage."""
    heads: int = 4
    """Attention heads."""
    seq: int = 16
    """Tokens per sample."""
    micro_batch: int = 2
    """Samples per microbatch."""
    seed: int = 0
    """Seed of the weights and the data."""
    jit: bool = False
    """Compile each block with mindspore.jit (slow first step, fast later ones)."""
    threads: int = 1
    """CPU threads per rank (MindSpore and OpenMP)."""

    def num_layers(self, num_stages: int) -> int:
        """The model has 2 * layers + 2 blocks; at least one block per stage."""
        return self.layers or max(1, -(-(num_stages - 2) // 2))


def setup_cpu(threads: int = 1) -> None:
    """PyNative on CPU with ``threads`` threads for MindSpore's runtime and OpenMP."""
    import mindspore as ms

    os.environ["OMP_NUM_THREADS"] = str(threads)
    ms.set_context(mode=ms.PYNATIVE_MODE, runtime_num_threads=threads)
    ms.set_device("CPU")


def toy_setup(config: ToyConfig, num_stages: int, num_microbatches: int):
    """(model, blocks of each stage, inputs, labels) for a schedule of ``num_stages`` stages."""
    from .toy import ToyModel, split_blocks, toy_batch

    model = ToyModel(config.vocab, config.d, config.num_layers(num_stages), config.heads, config.seed)
    placement = LayerPlacement.even(len(model.blocks), num_stages)
    blocks = split_blocks(list(model.blocks), placement)
    inputs, labels = toy_batch(num_microbatches, config.micro_batch, config.seq, config.vocab, config.seed + 1)
    return model, blocks, inputs, labels


def toy_rank(group, schedule_data: dict, config_data: dict, steps: int) -> dict:
    """One rank of :func:`run_toy` (module-level so that spawned processes can import it)."""
    config = ToyConfig(**config_data)
    setup_cpu(config.threads)
    from .executor import PipelineRuntime

    schedule = Schedule.from_dict(schedule_data)
    _, blocks, inputs, labels = toy_setup(config, schedule.num_stages, schedule.num_microbatches)
    mine = {s: blocks[s] for s in schedule.stages_of(group.rank)}
    shape = (config.micro_batch, config.seq, config.d)
    runtime = PipelineRuntime(schedule, mine, group, activation_shape=shape, jit=config.jit)
    times, result = [], None
    for _ in range(steps):
        runtime.zero_grads()
        start = time.perf_counter()
        result = runtime.step(inputs, labels)
        times.append(time.perf_counter() - start)
    return {"loss": result.loss, "grads": runtime.grads(), "times": times, "events": list(result.events)}


def run_toy(
    schedule: Schedule, config: ToyConfig | None = None, *, steps: int = 1, timeout: float = 600.0
) -> list[dict]:
    """Run ``steps`` training steps of the toy model on ``schedule.num_ranks`` local ranks."""
    from ms_layout.comm import run_local

    config = config or ToyConfig()
    env = {"OMP_NUM_THREADS": str(config.threads)}
    args = (schedule.to_dict(), asdict(config), steps)
    return run_local(toy_rank, schedule.num_ranks, backend="gloo", args=args, timeout=timeout, env=env)


# The pipelined step does the reference's float32 arithmetic grouped per stage and microbatch, so
# each gradient agrees to rounding relative to its own scale: a reordered sum of n terms moves by at
# most ~n * u (u = 2^-24); the toy's longest chain (vocabulary, a few blocks of width <= 4d, the
# step's tokens) stays under n = 1024.
RTOL = 1024 * 2.0**-24


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    """max|a - b| / max(max|a|, max|b|) (0 when both are zero)."""
    scale = float(max(np.abs(a).max(), np.abs(b).max()))
    err = float(np.abs(a - b).max())
    return err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))


def run_demo(schedule: Schedule, *, seed: int = 0, timeout: float = 600.0) -> dict:
    """One pipelined step against the single-process reference; a small report."""
    from .toy import reference_step

    config = ToyConfig(seed=seed)
    start = time.perf_counter()
    results = run_toy(schedule, config, timeout=timeout)
    wall = time.perf_counter() - start
    setup_cpu(config.threads)
    model, _, inputs, labels = toy_setup(config, schedule.num_stages, schedule.num_microbatches)
    ref_loss, ref_grads = reference_step(model, inputs, labels)
    err = max(float(np.abs(g - ref_grads[k]).max()) for r in results for k, g in r["grads"].items())
    rel = max(_relative(g, ref_grads[k]) for r in results for k, g in r["grads"].items())
    loss_rel = _relative(np.float64(results[0]["loss"]), np.float64(ref_loss))
    covered = {k for r in results for k in r["grads"]} == set(ref_grads)
    events = [e for r in results for e in r["events"] if e.action.is_compute]
    bubbles = Bubbles.of(events, schedule.num_ranks)
    problems = check_trace(schedule, events)
    return {
        "schedule": schedule.name,
        "ranks": schedule.num_ranks,
        "stages": schedule.num_stages,
        "microbatches": schedule.num_microbatches,
        "loss": results[0]["loss"],
        "reference_loss": ref_loss,
        "max_grad_error": err,
        "max_grad_rel_error": rel,
        "rtol": RTOL,
        "matches_reference": bool(covered and rel <= RTOL and loss_rel <= RTOL),
        "step_seconds": max(r["times"][-1] for r in results),
        "measured_bubble_rate": bubbles.bubble_rate,
        "replayed_bubble_rate": None if problems else replay(schedule, events).bubble_rate,
        "trace_problems": problems,
        "wall_seconds": wall,
    }
