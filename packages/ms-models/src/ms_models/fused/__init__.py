"""Fused CPU kernels for the explicit training passes: one pass over memory where MindSpore's graph
runs one kernel per elementwise op.

On a CPU without AVX-512, MindSpore 2.10's elementwise kernels run at a third to a half of torch's
speed (measured: ``Mul`` on [512, 688] float32, one core, 0.12-0.24 ms against torch's 0.09), so a
training step's RMSNorms, SwiGLU, RoPE, attention softmax and loss cost about twice torch's. The
kernels here (``kernels.cc``: RMSNorm and its input gradient, the scale gradient, SwiGLU and its
gradient, RoPE forward and inverse, masked softmax and its gradient, cross-entropy with its
residual) each read their inputs once and write their outputs once. They run as MindSpore
``Custom`` ops of type ``aot`` (compiled into the same graph under ``mindspore.jit``), built from
source on first use (:mod:`.build`).

When they are used: :data:`ON`, read by :mod:`ms_models.passes.ops` when a graph is compiled.
:func:`refresh` (called by every ``explicit_passes()``) sets it from :func:`enable`'s explicit
choice, else automatically: the device is CPU, MindSpore runs one thread per process
(``runtime_num_threads=1``: the kernels are single-threaded), ``$MS_MODELS_FUSED_KERNELS`` is not
``0`` and the library builds. ``MS_MODELS_FUSED_KERNELS=1`` uses them whatever the thread count.
Only float32 inputs take them; any other dtype takes the plain ops. The plain ops (the forms in
:mod:`ms_models.passes.ops`) stay the reference the tests compare these with.
"""

from __future__ import annotations

import os

import numpy as np
from mindspore import Tensor, ops

from .build import BuildError, library

ENV = "MS_MODELS_FUSED_KERNELS"
ON = False
"""Whether the explicit passes compiled from now on use the fused kernels."""
_explicit: bool | None = None
_why_not: str | None = None
_ops: dict = {}


def enable(on: bool | None) -> bool:
    """Use the fused kernels (True), never (False), or decide automatically (None); returns ON."""
    global _explicit
    _explicit = on
    return refresh()


def refresh() -> bool:
    """Set :data:`ON` from the explicit choice or the automatic rule (see the module's text)."""
    global ON
    ON = _explicit if _explicit is not None else _automatic()
    if ON:
        ON = _load()
    return ON


def why_not() -> str | None:
    """Why the fused kernels are off, in words (None when they are on)."""
    return None if ON else (_why_not or "turned off")


def _automatic() -> bool:
    global _why_not
    import mindspore as ms

    env = os.environ.get(ENV, "")
    if env == "0":
        _why_not = f"{ENV}=0"
        return False
    if ms.get_context("device_target") != "CPU":
        _why_not = f"device {ms.get_context('device_target')} (CPU kernels)"
        return False
    threads = ms.get_context("runtime_num_threads")
    if env != "1" and threads != 1:
        _why_not = f"runtime_num_threads={threads} (the kernels are single-threaded; {ENV}=1 forces them)"
        return False
    return True


def _load() -> bool:
    global _why_not
    if _ops:
        return True
    try:
        so = str(library())
    except (BuildError, OSError) as e:
        _why_not = str(e)
        return False

    def custom(name, shape, dtype):
        return ops.Custom(f"{so}:{name}", out_shape=shape, out_dtype=dtype, func_type="aot")

    same = lambda x, *_: x  # noqa: E731
    _ops.update(
        rms_norm=custom("rms_norm", lambda x, *_: (x, x, x[:-1] + [1]), lambda x, *_: (x, x, x)),
        rms_norm_dx=custom("rms_norm_dx", same, same),
        scale_dw=custom("scale_dw", lambda n, g: [n[-1]], same),
        swiglu=custom("swiglu", same, same),
        swiglu_dx=custom("swiglu_dx", lambda g, *_: (g, g), lambda g, *_: (g, g)),
        rope=custom("rope", same, same),
        masked_softmax=custom("masked_softmax", same, same),
        softmax_dx=custom("softmax_dx", same, same),
        cross_entropy=custom("cross_entropy", lambda x, y: ([x[0]], x), lambda x, y: (x, x)),
    )
    return True


def _const(*values) -> Tensor:
    return Tensor(np.array(values, np.float32))


def rms_norm(x, weight, eps: float):
    """(y, normed, inv_rms) as ``passes.ops.rms_norm`` (x, weight float32)."""
    return _ops["rms_norm"](x, weight, _const(eps))


def rms_norm_dx(g, weight, normed, inv):
    return _ops["rms_norm_dx"](g, weight, normed, inv)


def scale_dw(normed, g):
    return _ops["scale_dw"](normed, g)


def swiglu(gate, up):
    return _ops["swiglu"](gate, up)


def swiglu_dx(g, gate, up):
    return _ops["swiglu_dx"](g, gate, up)


def rope(x, cos, sin, interleave: bool, inverse: bool):
    """``apply_rope`` (inverse=False) or ``rope_dx`` (True); cos/sin [..., d/2] over x's leading dims."""
    return _ops["rope"](x, cos, sin, _const(float(interleave), float(inverse), 0.0))


def masked_softmax(scores, allowed, scale: float):
    """scores [N, M, Sq, Sk], allowed [N or 1, Sq, Sk] bool -> softmax(scale * scores) where allowed."""
    return _ops["masked_softmax"](scores, allowed, _const(scale))


def softmax_dx(dp, probs, scale: float):
    return _ops["softmax_dx"](dp, probs, _const(scale))


def cross_entropy(logits, labels):
    """logits [T, V] float32, labels [T] int32 in range -> (nll [T], softmax - onehot [T, V])."""
    return _ops["cross_entropy"](logits, labels)


__all__ = ["ENV", "ON", "BuildError", "enable", "refresh", "why_not"]
