"""Stage 1: pretrain the tiny DeepSeek-V3 with ZeroBubbleV on 2 local ranks, paired recompute,
monitored by ms-monitor.

Each rank (``ms_layout.comm.run_local``, gloo) builds the same model from the initial checkpoint,
cuts it into blocks, keeps the blocks of its two V stages, and runs ms-pipeline's
``PipelineRuntime`` with an ``nn.Adam``, compiled: each stage's F, B and W are ``mindspore.jit``
graphs over the blocks' explicit passes (B never re-runs the forward; W is the kept pairs'
GEMMs). ms-recompute's plan for the decoder layers of each stage (a pair never spans two stages)
becomes the stages' recompute flags: a recomputed layer keeps only its input from F to B, and
B's graph runs its forward again right before its backward. This model
has no tensor parallelism, so the plans pair layers with ``comms=0``: a pair has no communication
to overlap here. Paired recompute with real communication -- TP all-reduces in flight while the
partner layer computes -- is the recompute stage's (stages/recompute_tp.py). An
ms-monitor ``Monitor`` in each rank times every step (pipeline and optimizer ranges) and ships it
to a ``Daemon`` running in this process. The ranks return their trained weights; this stage
writes them as a sharded checkpoint (one safetensors file per rank, with a manifest) in the
layout they were trained in, which the reshard stage reads.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from common import TEXT, ModelSpec, StageResult, batches, setup_mindspore, timed, tokenize

FAULTS = ("", "perturb-weight", "lose-microbatch")
PERTURBED = "model.layers.2.self_attn.o_proj.weight"
"""The weight that the "perturb-weight" fault changes (layer 2 sits on rank 1's first stage)."""


@dataclass(frozen=True)
class PretrainConfig:
    """How the pipelined pretraining runs."""

    model: ModelSpec = field(default_factory=ModelSpec)
    """The model."""
    steps: int = 6
    """Optimizer steps."""
    microbatches: int = 3
    """Microbatches per step (ZeroBubbleV on p ranks fills its V from 2p-1)."""
    micro_batch: int = 2
    """Samples per microbatch."""
    seq: int = 16
    """Tokens per sample."""
    lr: float = 1e-2
    """Adam learning rate."""
    ranks: int = 2
    """Pipeline ranks (2p stages in a V)."""
    blocks_per_stage: tuple[int, ...] = (3, 1, 1, 1)
    """Blocks (embed, layers..., head) per stage: stage 0 holds the embedding and layers 0 and 1
    (one recompute pair), so rank 0 (stages 0 and 3: + the head) and rank 1 (layers 2 and 3)
    carry about the same work."""
    data_seed: int = 1
    """Seed of the batch offsets."""
    timeout: float = 900.0
    """Seconds before the ranks are given up."""
    fault: str = ""
    """A bug injected into the pipelined run, for the tests of the probe's checks: "" (none),
    "perturb-weight" (PERTURBED gets noise of 1 % of its scale before step 1) or
    "lose-microbatch" (every stage drops the weight gradients of microbatch 1 in step 1)."""

    def __post_init__(self):
        if self.fault not in FAULTS:
            raise ValueError(f"fault={self.fault!r} is not one of {FAULTS}")

    def layer_counts(self) -> list[int]:
        """Decoder layers per stage (the embedding is block 0, the head the last block)."""
        bounds = np.cumsum((0, *self.blocks_per_stage))
        n = self.model.layers
        return [sum(1 for b in range(lo, hi) if 1 <= b <= n) for lo, hi in zip(bounds[:-1], bounds[1:])]


def recompute_plans(config: PretrainConfig) -> dict[int, str]:
    """Per stage, the recompute plan over its own decoder layers: the stages holding two or more
    layers recompute them fully, in pairs; a pair never spans two stages. A stage with one layer
    keeps its activations (recompute costs one more forward of each recomputed layer)."""
    out = {}
    for stage, n in enumerate(config.layer_counts()):
        if n > 1:
            out[stage] = f"0-{n - 1}=full"
    return out


def _recompute_flags(config: PretrainConfig, mine: dict) -> tuple[dict[int, list[bool]], dict[int, str]]:
    """Each of this rank's stage plans as the stage's recompute flags (one per block: the
    fully recomputed decoder layers); returns the flags and the plans' text."""
    from ms_recompute import Granularity, RecomputePlan

    flags, plans = {}, {}
    for s, spec in recompute_plans(config).items():
        if s in mine:
            layers = [i for i, b in enumerate(mine[s]) if hasattr(b, "layer")]  # the decoder-layer blocks
            plan = RecomputePlan.parse(spec, len(layers), overlap=True, comms=0)
            full = {layers[lp.layer] for lp in plan.layers if lp.granularity is Granularity.FULL}
            flags[s] = [i in full for i in range(len(mine[s]))]
            plans[s] = plan.format()
    return flags, plans


def _build(group, config: PretrainConfig, init_dir: str, probe=None, model=None):
    """(runtime, this rank's parameters by name, the recompute plans' text). With a `probe`
    (ms-probe's PrecisionDebugger) the runtime runs eagerly for it: modules are called as Cells
    only in PyNative, B and W re-run the stage's forward inside ``ms.grad`` (dw="recompute"), and
    no layer is recomputed (the forward a recompute repeats is what dw="recompute" repeats).
    `model`: the model to cut (None: the initial checkpoint's)."""
    import mindspore as ms

    import ms_models
    import ms_pipeline as mp

    model = ms_models.from_pretrained(init_dir) if model is None else model
    placement = mp.LayerPlacement.from_counts(config.blocks_per_stage)
    staged = mp.runtime.split_blocks(ms_models.pipeline_blocks(model), placement)
    schedule = mp.zero_bubble_v(config.ranks, config.microbatches)
    mine = {s: staged[s] for s in schedule.stages_of(group.rank)}
    flags, plans = _recompute_flags(config, mine) if probe is None else ({}, {})
    params = {p.name: p for s in mine for b in mine[s] for p in b.get_parameters()}
    optimizer = ms.nn.Adam([p for p in params.values() if p.requires_grad], learning_rate=config.lr)
    shape = (config.micro_batch, config.seq, model.config.hidden_size)
    compiled = {"jit": True, "recompute": flags} if probe is None else {"dw": "recompute", "probe": probe}
    runtime = mp.runtime.PipelineRuntime(schedule, mine, group, activation_shape=shape, optimizer=optimizer, **compiled)
    return runtime, params, plans


def _inject(fault: str, runtime, params: dict) -> None:
    """Put the configured bug into step 1 of this rank's pipelined run (see PretrainConfig.fault);
    :func:`_heal` takes a lost-microbatch bug out again after that step."""
    import mindspore as ms

    if fault == "perturb-weight" and PERTURBED in params:
        p = params[PERTURBED]
        w = p.asnumpy()
        noise = np.random.default_rng(0).normal(0.0, 0.01 * float(np.abs(w).max()), w.shape)
        p.set_data(ms.Tensor((w + noise).astype(w.dtype)))
    elif fault == "lose-microbatch":
        for stage in runtime.stages.values():
            _lose_gradients(stage, microbatch=1)


def _lose_gradients(stage, microbatch: int) -> None:
    """Wrap a Stage's backward passes so that microbatch `microbatch`'s weight gradients are
    dropped: its accumulators are put back as they were before each of its passes."""
    for name in ("backward_input", "backward_weight", "backward_full"):
        original = getattr(stage, name)

        def wrapped(mb, *args, _original=original):
            before = stage.grads if mb == microbatch else None  # a copy
            out = _original(mb, *args)
            if before is not None:
                stage.set_grads(before)
            return out

        setattr(stage, name, wrapped)  # an instance attribute over the class's method


def _heal(runtime) -> None:
    for stage in runtime.stages.values():
        for name in ("backward_input", "backward_weight", "backward_full"):
            stage.__dict__.pop(name, None)


def _rank(group, config_data: dict, init_dir: str, monitor_addr: str) -> dict:
    """One pipeline rank (module-level: spawned processes import it)."""
    import mindspore as ms
    from tqdm import tqdm

    from ms_monitor import Monitor

    config = _config(config_data)
    setup_mindspore(1)
    runtime, params, plans = _build(group, config, init_dir)
    _inject(config.fault, runtime, params)
    data = batches(
        tokenize(init_dir, TEXT), config.steps, config.microbatches, config.micro_batch, config.seq, config.data_seed
    )
    monitor = Monitor(
        rank=group.rank, world_size=group.size, addr=monitor_addr, job="demo-pretrain",
        tokens_per_step=config.microbatches * config.micro_batch * config.seq,
    )  # fmt: skip
    bar = tqdm(total=config.steps, desc="  pretrain (ZBV, 2 ranks)", unit="step", disable=group.rank != 0)
    losses, times, events = [], [], []
    # what the probe stage compares against the single-process reference: the weights step 1
    # began with, the gradients it accumulated and the weights after it
    first = {f"began/{name}": p.asnumpy().copy() for name, p in params.items()}
    for step in range(config.steps):
        inputs = [ms.Tensor(x) for x, _ in data[step]]
        labels = [ms.Tensor(y) for _, y in data[step]]
        start = time.perf_counter()
        with monitor.step():
            with monitor.range("pipeline"):
                result = runtime.step(inputs, labels)
            if step == 0:
                first.update({f"grad/{name}": g.copy() for name, g in runtime.grads().items()})
                _heal(runtime)
            with monitor.range("optimizer"):
                runtime.optimizer_step()
        times.append(time.perf_counter() - start)
        losses.append(result.loss)
        events = list(result.events)
        if step == 0:
            first.update({f"after/{name}": p.asnumpy().copy() for name, p in params.items()})
        bar.update(1)
        bar.set_postfix(loss=f"{result.loss:.3f}")
    bar.close()
    monitor.close()
    return {
        "rank": group.rank,
        "losses": losses,
        "times": times,
        "events": events,
        "plans": plans,
        "stages": sorted(runtime.stages),
        "params": {name: p.asnumpy().copy() for name, p in params.items()},
        "step_1": first,
    }


def _config(data: dict) -> PretrainConfig:
    data = dict(data)
    data["model"] = ModelSpec(**data["model"])
    data["blocks_per_stage"] = tuple(data["blocks_per_stage"])
    return PretrainConfig(**data)


def train_specs(owner: dict[str, int], shapes: dict[str, tuple]):
    """ms-reshard specs of the trained weights: each parameter whole on the rank of its V stage.
    (ms_reshard.param_specs places pipeline stages in a loop, c % pp; ZeroBubbleV's V puts the
    head on rank 0, so the demo states the placement itself.)"""
    from ms_layout import Layout
    from ms_reshard import ParamSpec

    return {
        name: ParamSpec(Layout((1,), ("pp",), rank_list=(owner[name],))(*["None"] * len(shapes[name])), shapes[name])
        for name in sorted(owner)
    }


def _steps_seen(series: dict) -> dict[int, int]:
    return {r: sum(v is not None for v in row) for r, row in zip(series["ranks"], series["step_time"])}


def _series_when_complete(url: str, ranks: int, steps: int, deadline_s: float = 30.0) -> dict:
    """The daemon's per-rank series once every rank's last step has arrived (the agents send
    asynchronously, later on a loaded box), or as it is at the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        series = json.load(urllib.request.urlopen(url + "/api/series?last=1000", timeout=10))
        seen = _steps_seen(series)
        if all(seen.get(r, 0) >= steps for r in range(ranks)) or time.monotonic() > end:
            return series
        time.sleep(0.2)


def _train_monitored(config: PretrainConfig, init_dir: str, work: Path) -> tuple[list[dict], dict, dict]:
    """Run the ranks with an ms-monitor daemon in this process; (rank results, the daemon's
    per-rank step series, its status)."""
    from ms_layout.comm import run_local
    from ms_monitor import Daemon, DaemonConfig

    daemon = Daemon(DaemonConfig(port=0, http_port=0, trace_dir=str(work / "monitor-traces"))).start_in_thread()
    try:
        ranks = run_local(
            _rank, config.ranks, backend="gloo", args=(asdict(config), init_dir, daemon.agent_addrs[0]),
            timeout=config.timeout, env={"OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        series = _series_when_complete(daemon.http_url, config.ranks, config.steps)
        status = json.load(urllib.request.urlopen(daemon.http_url + "/api/status", timeout=10))
    finally:
        daemon.stop()
    return ranks, series, status


def _draw(config: PretrainConfig, ranks: list[dict], work: Path) -> float:
    """The schedule as built and the last step as run (ms-pipeline's drawing); the measured bubble."""
    import ms_pipeline as mp

    schedule = mp.zero_bubble_v(config.ranks, config.microbatches)
    title = f"ZeroBubbleV, p={config.ranks}, m={config.microbatches}"
    mp.draw_png(schedule, work / "zbv_schedule.png", title=title)
    events = [e for r in ranks for e in r["events"]]
    mp.draw_png(
        events, work / "zbv_measured.png", stage_to_rank=schedule.stage_to_rank, xlabel="seconds",
        title="ZeroBubbleV, last training step as run (compiled, 2 ranks)",
    )  # fmt: skip
    return mp.Bubbles.of([e for e in events if e.action.is_compute], config.ranks).bubble_rate


def _save(ranks: list[dict], work: Path) -> dict[str, int]:
    """The trained weights as a sharded checkpoint (one file per rank, a manifest with checksums),
    and step 1's weights and gradients for the probe; returns each parameter's rank."""
    from safetensors.numpy import save_file

    from ms_reshard import save_checkpoint

    owner = {name: r["rank"] for r in ranks for name in r["params"]}
    arrays = {name: r["params"][name] for r in ranks for name in r["params"]}
    specs = train_specs(owner, {name: tuple(a.shape) for name, a in arrays.items()})
    save_checkpoint(work / "train_ckpt", specs, {n: {owner[n]: arrays[n]} for n in specs}, overwrite=True)
    step1 = {name: a for r in ranks for name, a in r["step_1"].items()}
    tmp = work / "pipeline_step1.safetensors.tmp"
    save_file(step1, str(tmp))
    tmp.replace(work / "pipeline_step1.safetensors")
    return owner


def run(config: PretrainConfig, work: Path) -> StageResult:
    import ms_models

    result = StageResult("pretrain")
    with timed(result):
        init_dir = ms_models.make_tiny(
            config.model.arch, work / "init", seed=config.model.seed, **config.model.overrides()
        )
        ranks, series, status = _train_monitored(config, init_dir, work)
        bubble_rate = _draw(config, ranks, work)
        owner = _save(ranks, work)

        losses = ranks[0]["losses"]
        expected = {p.name for p in ms_models.from_pretrained(init_dir).get_parameters()}
        result.check(
            "every weight trained on exactly one rank",
            set(owner) == expected and sum(len(r["params"]) for r in ranks) == len(expected),
            f"{len(expected)} parameters; rank 0 {len(ranks[0]['params'])}, rank 1 {len(ranks[1]['params'])}",
        )
        result.check("ranks agree on every loss", all(r["losses"] == losses for r in ranks), f"{len(losses)} steps")
        result.check(
            "loss falls", np.isfinite(losses).all() and losses[-1] < 0.9 * losses[0],
            f"{losses[0]:.3f} -> {losses[-1]:.3f}",
        )  # fmt: skip
        seen = _steps_seen(series)
        result.check(
            "monitor daemon received every step of every rank",
            all(seen.get(r, 0) >= config.steps for r in range(config.ranks)),
            f"steps seen per rank {seen}",
        )
        step_ms = [1e3 * float(np.median(r["times"][1:] or r["times"])) for r in ranks]
        result.numbers = {
            "init_dir": str(init_dir),
            "losses": losses,
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "median_step_ms": max(step_ms),
            "measured_bubble_rate": bubble_rate,
            "recompute_plans": {f"rank {r['rank']} stage {s}": text for r in ranks for s, text in r["plans"].items()},
            "stages_of_rank": {r["rank"]: r["stages"] for r in ranks},
            "monitor_alerts": [a.get("kind", "") + ": " + a.get("message", "") for a in status.get("alerts", [])],
            "monitor_series": series,
            "params": len(expected),
        }
    return result
