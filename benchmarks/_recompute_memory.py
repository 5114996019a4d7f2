"""bench_recompute's memory table: one training step of a single-device model per recompute plan,
in a fresh process each, what the tape keeps against the formula and the resident set."""

from __future__ import annotations

import numpy as np

# 8 single-device Llama layers, hidden 256, batch 4 x 256, fresh process per plan
MEMORY_PLANS = ("", "0-7=mlp", "0-7=full")
MEMORY_LAYERS, MEMORY_BATCH, MEMORY_SEQ = 8, 4, 256


def _rss_mib() -> tuple[float, float]:
    """(current, peak) resident set of this process, MiB, from /proc (Linux)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def _memory(group, spec: str) -> dict:
    """One training step of a single-device model under ``spec``: what the tape keeps (meter), and
    the process's resident memory after the forward and at its peak, above the state before it."""
    import gc

    import mindspore as ms
    from mindspore import ops

    import ms_models
    from ms_recompute import RecomputePlan, Shape, model_memory, predict
    from ms_recompute.runtime import SavedTensorMeter, apply_plan

    ms.set_device("CPU")
    config = ms_models.tiny_config(
        "llama",
        num_hidden_layers=MEMORY_LAYERS,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        head_dim=64,
    )
    model = ms_models.from_config(config, seed=0)
    ids = ms.Tensor(
        np.random.default_rng(0).integers(0, config.vocab_size, (MEMORY_BATCH, MEMORY_SEQ)).astype(np.int32)
    )
    params = model.trainable_params()
    marks = {}

    def loss(ids):
        out = ops.cross_entropy(model(ids).reshape(-1, config.vocab_size), ids.reshape(-1))
        out.asnumpy()
        gc.collect()
        marks["after_forward"] = _rss_mib()[0]
        return out

    plan = RecomputePlan.parse(spec, MEMORY_LAYERS, comms=0)
    # warm-up without gradients: kernels built, and the pool holds one forward's temporaries. A warm-up
    # step with gradients would leave the pool holding a whole step, and RSS would not move at all.
    model(ids).asnumpy()
    with apply_plan(model, plan) as applied:
        gc.collect()
        start = _rss_mib()[0]
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current resident set
        with SavedTensorMeter(exclude=model.get_parameters(), runners=[applied.runner]) as meter:
            ms.grad(loss, grad_position=None, weights=params)(ids)[0].asnumpy()
    layers = model_memory(config, Shape(MEMORY_BATCH, MEMORY_SEQ))
    return {
        "plan": spec or "none",
        "formula_kept_MiB": round(predict(plan, layers).kept_bytes / 2**20, 1),
        "tape_kept_MiB": round(meter.bytes / 2**20, 1),
        "rss_after_forward_MiB": round(marks["after_forward"] - start, 1),
        "rss_peak_MiB": round(_rss_mib()[1] - start, 1),
    }
