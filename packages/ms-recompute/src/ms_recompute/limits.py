"""Bounds on the sizes ms-recompute reads from configs, plan files and flags (``ms_layout.limits``)."""

from __future__ import annotations

from ms_layout.limits import Limit

MAX_LAYERS = Limit("MS_RECOMPUTE_MAX_LAYERS", 256, "layers")
"""Decoder layers of a config or a plan: one entry (and one planner option list) is built per layer,
so ``num_layers: 1000000000`` in a plan file is refused instead of filling memory."""
MAX_COMMS = Limit("MS_RECOMPUTE_MAX_COMMS", 64, "collectives per layer")
"""Collectives per recomputed layer: the recompute order holds a step for each."""
MAX_PLAN_BYTES = Limit("MS_RECOMPUTE_MAX_PLAN_BYTES", 16 << 20, "bytes")
"""Size of one plan file or config.json read."""
MAX_EXACT_WORK = Limit("MS_RECOMPUTE_MAX_EXACT_WORK", 2_000_000, "planner states")
"""States the exact planner may grow (over all working-set caps) before ``auto`` falls back to the
greedy one: the Pareto frontier can grow to max_states per layer, which took minutes at 64 layers."""
