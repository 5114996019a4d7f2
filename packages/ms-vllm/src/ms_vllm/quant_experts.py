"""Quantized routed experts: W8A8 static and W4A16 for the stacked SwiGLU experts of a MoE layer,
and the per-expert calibration W8A8 needs.

On disk each routed expert's projection is stored like any quantized linear layer, under its
checkpoint name (`model.layers.N.mlp.experts.E.gate_proj.weight` int8 + `weight_scale` +
`input_scale` for W8A8; `weight_packed` + `weight_scale` + `weight_shape` for W4A16). In memory the
experts of a layer are stacked again, [E, out, in], and run as one batched matmul per projection,
like the float `ms_models.moe.Experts` (same `mix` / `dense` interface, so the compiled serving
steps and the EP experts graph take them unchanged):

* W8A8: one static activation scale per expert and per input (x for gate/up, the SwiGLU product
  for down), recorded on the calibration tokens routed to that expert; int8 values multiplied in
  int32 (CPU's int8 matmul wraps around), rescaled by input_scale * weight_scale.
* W4A16: int4 groups unpacked to int8 once at load; each call dequantizes the stack and multiplies
  in float (on Ascend the fused WeightQuantBatchMatmul does this inside the kernel).
"""

from __future__ import annotations

import re

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore import dtype as mstype

from ms_models.moe import Experts

from .quant_checks import QuantError

#: a routed expert's projection in a checkpoint: (experts prefix, expert index, projection)
EXPERT_WEIGHT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class _StackedExperts(nn.Cell):
    """What the quantized stacks share with the float Experts: `dense` routes through `mix`."""

    dense = Experts.dense

    def dispatch(self, x, weights, indices):
        """The quantized stacks always run every expert (the sparse PyNative path is float-only)."""
        return self.dense(x, weights, indices)


class W8A8Experts(_StackedExperts):
    """Stacked int8 experts with per-expert static activation scales."""

    def __init__(self, weights: dict, weight_scales: dict, input_scales: dict):
        super().__init__()
        self.num_experts = weights["gate_proj"].shape[0]
        self.int8_bytes = sum(w.size for w in weights.values())
        self.scale_bytes = 4 * sum(s.size for s in weight_scales.values()) + 4 * sum(
            s.size for s in input_scales.values()
        )
        bmm = ops.BatchMatMul(transpose_b=True)
        self.bmm = bmm
        # gate and up read the same input: one scale (the larger) quantizes it once for both
        x_scale = np.maximum(input_scales["gate_proj"], input_scales["up_proj"]).astype(np.float32)
        h_scale = input_scales["down_proj"].astype(np.float32)
        self.x_scale = Tensor(x_scale[:, None, None])
        self.h_scale = Tensor(h_scale[:, None, None])
        self.gate_q = Tensor(weights["gate_proj"].astype(np.int32))
        self.up_q = Tensor(weights["up_proj"].astype(np.int32))
        self.down_q = Tensor(weights["down_proj"].astype(np.int32))
        self.gate_dq = Tensor((weight_scales["gate_proj"] * x_scale[:, None])[:, None, :].astype(np.float32))
        self.up_dq = Tensor((weight_scales["up_proj"] * x_scale[:, None])[:, None, :].astype(np.float32))
        self.down_dq = Tensor((weight_scales["down_proj"] * h_scale[:, None])[:, None, :].astype(np.float32))

    def _quantize(self, x, scale):
        return ops.clip_by_value(ops.round(x / scale), Tensor(-128.0), Tensor(127.0)).astype(mstype.int32)

    def mix(self, x, combine):
        """sum_e combine[:, e] * expert_e(x), x [M, H], combine [M, E] (as Experts.mix)."""
        xq = self._quantize(ops.broadcast_to(x.expand_dims(0), (self.num_experts,) + x.shape), self.x_scale)
        gate = self.bmm(xq, self.gate_q).astype(mstype.float32) * self.gate_dq
        up = self.bmm(xq, self.up_q).astype(mstype.float32) * self.up_dq
        h = self._quantize(ops.silu(gate) * up, self.h_scale)
        y = self.bmm(h, self.down_q).astype(mstype.float32) * self.down_dq  # [E, M, H]
        return (combine.T.expand_dims(-1).astype(y.dtype) * y).sum(0)


class W4A16Experts(_StackedExperts):
    """Stacked int4 experts (held as int8) with per-group scales; float activations."""

    def __init__(self, values: dict, scales: dict, group: int, packed_bytes: int):
        super().__init__()
        self.num_experts = values["gate_proj"].shape[0]
        self.group = group
        self.packed_bytes = packed_bytes
        self.bmm = ops.BatchMatMul(transpose_b=True)
        self.shapes = {p: values[p].shape for p in PROJECTIONS}
        for p in PROJECTIONS:
            e, out_f, in_f = values[p].shape
            setattr(self, f"{p}_q", Tensor(values[p].reshape(e, out_f, in_f // group, group)))
            setattr(self, f"{p}_s", Tensor(scales[p].astype(np.float32)[..., None]))

    def _weight(self, q, s, shape):
        return (q.astype(mstype.float32) * s).reshape(shape)

    def mix(self, x, combine):
        """sum_e combine[:, e] * expert_e(x), x [M, H], combine [M, E] (as Experts.mix)."""
        xe = ops.broadcast_to(x.expand_dims(0), (self.num_experts,) + x.shape)
        gate = self.bmm(xe, self._weight(self.gate_proj_q, self.gate_proj_s, self.shapes["gate_proj"]))
        up = self.bmm(xe, self._weight(self.up_proj_q, self.up_proj_s, self.shapes["up_proj"]))
        h = ops.silu(gate) * up
        y = self.bmm(h, self._weight(self.down_proj_q, self.down_proj_s, self.shapes["down_proj"]))
        return (combine.T.expand_dims(-1).astype(y.dtype) * y).sum(0)


# ------------------------------------------------------------------ calibration
def routed_amax(moe, flat: np.ndarray) -> dict[int, tuple[float, float]]:
    """expert -> (max |x|, max |silu(gate x) * up x|) over the rows of `flat` [M, H] the router sends
    to that expert (all rows for an expert no row reaches, so every expert gets a scale)."""
    _, indices = moe.gate(Tensor(flat))
    chosen = indices.asnumpy()
    experts = moe.experts
    out = {}
    for e in range(experts.num_experts):
        rows = np.nonzero((chosen == e).any(-1))[0]
        xe = flat[rows] if rows.size else flat
        gate = xe @ experts.gate_proj.asnumpy()[e].T
        h = gate / (1.0 + np.exp(-gate)) * (xe @ experts.up_proj.asnumpy()[e].T)
        out[e] = (float(np.abs(xe).max()), float(np.abs(h).max()))
    return out


def calibrate_experts(model, run) -> dict[str, dict[int, tuple[float, float]]]:
    """MoE cell name -> routed_amax over everything `run()` feeds the model (forward pre-hooks)."""
    stats: dict[str, dict[int, tuple[float, float]]] = {}
    handles = []
    for name, cell in model.cells_and_names():
        if type(cell).__name__ != "MoE":
            continue

        def hook(cell, inputs, name=name):
            x = inputs[0].asnumpy()
            new = routed_amax(cell, x.reshape(-1, x.shape[-1]).astype(np.float32))
            old = stats.setdefault(name, {})
            for e, (a, b) in new.items():
                pa, pb = old.get(e, (0.0, 0.0))
                old[e] = (max(a, pa), max(b, pb))

        handles.append(cell.register_forward_pre_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return stats


def expert_input_amax(stats: dict, hub_prefix_of) -> dict[str, float]:
    """Checkpoint name of each expert projection -> its input's absolute maximum (from calibrate_experts);
    `hub_prefix_of(cell_name)` maps a MoE cell name to its checkpoint `...mlp.experts` prefix."""
    out = {}
    for cell_name, per_expert in stats.items():
        prefix = hub_prefix_of(cell_name)
        for e, (x_amax, h_amax) in per_expert.items():
            out[f"{prefix}.{e}.gate_proj"] = out[f"{prefix}.{e}.up_proj"] = x_amax
            out[f"{prefix}.{e}.down_proj"] = h_amax
    return out


# ------------------------------------------------------------------ loading
def stack_experts(raw: dict, prefix: str, num_experts: int, method: str, group: int):
    """Pop expert `prefix`'s per-expert quantized tensors from `raw` and build its stacked layer."""
    from .quant import unpack_int4

    def take(e: int, p: str, key: str):
        name = f"{prefix}.{e}.{p}.{key}"
        if name not in raw:
            raise QuantError(f"the checkpoint lacks the quantized expert tensor {name!r}")
        return raw.pop(name)

    experts = range(num_experts)
    if method == "ms_w8a8":
        weights = {p: np.stack([take(e, p, "weight") for e in experts]) for p in PROJECTIONS}
        w_scales = {p: np.stack([take(e, p, "weight_scale") for e in experts]) for p in PROJECTIONS}
        in_scales = {p: np.concatenate([take(e, p, "input_scale") for e in experts]) for p in PROJECTIONS}
        return W8A8Experts(weights, w_scales, in_scales)
    values, scales, packed_bytes = {}, {}, 0
    for p in PROJECTIONS:
        packed = [take(e, p, "weight_packed") for e in experts]
        scale = [take(e, p, "weight_scale") for e in experts]
        for e in experts:
            raw.pop(f"{prefix}.{e}.{p}.weight_shape", None)
        packed_bytes += sum(a.nbytes for a in packed) + sum(s.nbytes for s in scale)
        values[p] = np.stack([unpack_int4(a) for a in packed])
        scales[p] = np.stack(scale)
    return W4A16Experts(values, scales, group, packed_bytes)


def expert_bytes(cell) -> int | None:
    """Stored bytes of a quantized expert stack (None for any other cell)."""
    if isinstance(cell, W8A8Experts):
        return cell.int8_bytes + cell.scale_bytes
    if isinstance(cell, W4A16Experts):
        return cell.packed_bytes
    return None
