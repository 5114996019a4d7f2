"""The forward and backward of each operation a decoder is made of, written out by hand.

Each backward takes what its forward saved and the output gradient, and returns the input
gradient; a weight's gradient is never computed here but left as a pair for the W pass
(:func:`linear_dw` and friends), which is what lets a pipeline schedule run it later. Nothing is
re-run: the forward keeps every value its backward needs. All functions are plain MindSpore ops
with CPU kernels and compile under ``mindspore.jit``; no weight is transposed (``MatMul``'s
``transpose_a`` / ``transpose_b`` read it as stored). Where :data:`ms_models.fused.ON` is set when
a graph is compiled, the elementwise chains (RMSNorm, SwiGLU, RoPE, the attention softmax, the
loss) run as one fused CPU kernel each on float32 values instead; the forms below are what those
kernels compute (the tests compare the two).
"""

from __future__ import annotations

from mindspore import dtype as mstype
from mindspore import ops

from .. import fused
from ..layers import NEG_INF, apply_rope, linear

_MATMUL = ops.MatMul()
_MATMUL_TN = ops.MatMul(transpose_a=True)
_BMM_NT = ops.BatchMatMul(transpose_b=True)
_BMM_TN = ops.BatchMatMul(transpose_a=True)


def _flat(x):
    return x.reshape(-1, x.shape[-1])


def _f32(*xs) -> bool:
    """Every tensor is float32 (a constant when a graph is compiled, as the fused kernels need)."""
    ok = True
    for x in xs:
        ok = ok and x.dtype == mstype.float32
    return ok


# ---------------------------------------------------------------- linear: y = x W^T (+ b)
def linear_dx(g, weight):
    """dL/dx of ``y = x W^T`` for g [..., out], W [out, in] -> [..., in] (no transpose of W)."""
    return _MATMUL(_flat(g), weight).reshape(g.shape[:-1] + (weight.shape[1],))


def linear_dw(x, g):
    """dL/dW = g^T x summed over every leading dim: x [..., in], g [..., out] -> [out, in]."""
    return _MATMUL_TN(_flat(g), _flat(x))


def bias_dw(g):
    """dL/db = sum of g over every leading dim."""
    return _flat(g).sum(0)


def scale_dw(normed, g):
    """Gradient of an elementwise scale ``y = w * normed`` (RMSNorm's weight): sum(normed * g)."""
    if fused.ON and _f32(normed, g):
        return fused.scale_dw(normed, g)
    return _flat(normed * g).sum(0)


def stacked_linear_dw(x, g):
    """Per-expert dL/dW of ``y[e] = x[e] W[e]^T``: x [E, M, in], g [E, M, out] -> [E, out, in]."""
    return _BMM_TN(g, x)


def embedding_dw(ids, g, vocab: int):
    """dL/d(table) of a row lookup: each token's gradient added to its row, [vocab, hidden]."""
    return ops.unsorted_segment_sum(_flat(g), ids.reshape(-1), vocab)


# ---------------------------------------------------------------- RMSNorm
def rms_norm(x, weight, eps: float):
    """-> (y, normed, inv_rms): y = weight * x / sqrt(mean(x^2) + eps), in float32."""
    x = x.astype(mstype.float32)
    if fused.ON and _f32(weight):
        return fused.rms_norm(x, weight, eps)
    inv = ops.rsqrt((x * x).mean(-1, keep_dims=True) + eps)
    normed = x * inv
    return weight * normed, normed, inv


def rms_norm_dx(g, weight, normed, inv):
    """dL/dx of RMSNorm from its saved normed input and 1 / rms."""
    if fused.ON and _f32(g, weight, normed):
        return fused.rms_norm_dx(g, weight, normed, inv)
    gn = g * weight
    return inv * (gn - normed * (gn * normed).mean(-1, keep_dims=True))


# ---------------------------------------------------------------- RoPE
def _rope_fusable(x, cos, sin) -> bool:
    return fused.ON and _f32(x, cos, sin) and cos.shape[:-1] == x.shape[:-2] and 2 * cos.shape[-1] == x.shape[-1]


def rope(x, cos, sin, interleave: bool = False):
    """``ms_models.layers.apply_rope``: x [..., heads, d] rotated by cos/sin [..., d/2]."""
    if _rope_fusable(x, cos, sin):
        return fused.rope(x, cos, sin, interleave, False)
    return apply_rope(x, cos, sin, interleave)


def rope_dx(g, cos, sin, interleave: bool = False):
    """dL/dx of ``apply_rope``: the inverse rotation of the output gradient, put back in the
    input's element order (pairs (i, i + d/2), or (2i, 2i + 1) with ``interleave``)."""
    if _rope_fusable(g, cos, sin):
        return fused.rope(g, cos, sin, interleave, True)
    half = g.shape[-1] // 2
    cos, sin = cos.expand_dims(-2), sin.expand_dims(-2)
    g1, g2 = g[..., :half], g[..., half:]
    x1, x2 = g1 * cos + g2 * sin, g2 * cos - g1 * sin
    if interleave:
        return ops.stack((x1, x2), -1).reshape(g.shape)
    return ops.cat((x1, x2), -1)


# ---------------------------------------------------------------- attention core
def attention(q, k, v, allowed, scale: float):
    """Softmax attention as ``ms_models.attention.attend`` computes it, keeping what its backward
    needs. q [N, Sq, Hq, d], k [N, Sk, Hkv, d], v [N, Sk, Hkv, dv], allowed [N, 1, Sq, Sk] ->
    (out [N, Sq, Hq * dv], saved). Query heads of one kv group are folded into the query axis."""
    n, sq, hq, d = q.shape
    hkv = k.shape[2]
    groups = hq // hkv
    qf = q.reshape(n, sq, hkv, groups, d).transpose(0, 2, 3, 1, 4).reshape(n, hkv, groups * sq, d)
    k4, v4 = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [N, Hkv, Sk, d | dv]
    sk = k.shape[1]
    if fused.ON and allowed.dtype == mstype.bool_ and allowed.shape[0] in (1, n) and allowed.shape[1] == 1:
        scores = _BMM_NT(qf.astype(mstype.float32), k4.astype(mstype.float32))
        probs = fused.masked_softmax(scores.reshape(n, hq, sq, sk), allowed.reshape(-1, sq, sk), scale)
        return _attention_out(probs.reshape(n, hkv, groups * sq, sk), v4, qf, k4, groups)
    scores = _BMM_NT(qf.astype(mstype.float32), k4.astype(mstype.float32)) * scale
    scores = scores.reshape(n, hkv, groups, sq, sk)
    mask = allowed.expand_dims(1)
    probs = ops.softmax(ops.where(mask, scores, ops.full_like(scores, NEG_INF)), -1)
    return _attention_out(probs.reshape(n, hkv, groups * sq, sk), v4, qf, k4, groups)


def _attention_out(probs, v4, qf, k4, groups: int):
    """(probs @ v as [N, Sq, Hq * dv], saved) from probs [N, Hkv, G * Sq, Sk]."""
    n, hkv, gsq, _ = probs.shape
    sq, dv = gsq // groups, v4.shape[-1]
    out = ops.matmul(probs, v4).reshape(n, hkv, groups, sq, dv)
    out = out.transpose(0, 3, 1, 2, 4).reshape(n, sq, hkv * groups * dv)
    return out, (qf, k4, v4, probs)


def attention_dx(g, saved, scale: float, num_heads: int):
    """-> (dq [N, Sq, Hq, d], dk [N, Sk, Hkv, d], dv [N, Sk, Hkv, dv]) from the saved values."""
    qf, k4, v4, probs = saved
    n, hkv, gsq, d = qf.shape
    dv_dim = v4.shape[-1]
    groups = num_heads // hkv
    sq = gsq // groups
    go = g.reshape(n, sq, hkv, groups, dv_dim).transpose(0, 2, 3, 1, 4).reshape(n, hkv, gsq, dv_dim)
    dv = _BMM_TN(probs, go)  # [N, Hkv, Sk, dv]
    dp = _BMM_NT(go, v4)  # [N, Hkv, G*Sq, Sk]
    if fused.ON and _f32(dp, probs):
        ds = fused.softmax_dx(dp, probs, scale)
    else:
        ds = probs * (dp - (dp * probs).sum(-1, keepdims=True)) * scale
    dq = ops.matmul(ds, k4)  # [N, Hkv, G*Sq, d]
    dk = _BMM_TN(ds, qf)  # [N, Hkv, Sk, d]
    dq = dq.reshape(n, hkv, groups, sq, d).transpose(0, 3, 1, 2, 4).reshape(n, sq, num_heads, d)
    return dq, dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)


# ---------------------------------------------------------------- SwiGLU
def swiglu(gate, up):
    """silu(gate) * up."""
    if fused.ON and _f32(gate, up):
        return fused.swiglu(gate, up)
    return ops.silu(gate) * up


def swiglu_dx(g, gate, up):
    """-> (d gate, d up) of ``silu(gate) * up``."""
    if fused.ON and _f32(g, gate, up):
        return fused.swiglu_dx(g, gate, up)
    sig = ops.sigmoid(gate)
    silu = gate * sig
    return g * up * sig * (1.0 + gate * (1.0 - sig)), g * silu


# ---------------------------------------------------------------- the loss
IGNORE_INDEX = -100
"""Labels equal to this take no part in the loss (``ops.cross_entropy``'s default)."""


def cross_entropy(logits, labels):
    """Mean next-token cross-entropy over the labels that are not IGNORE_INDEX.
    logits [..., V], labels [...] -> (loss, saved)."""
    logits = _flat(logits).astype(mstype.float32)
    labels = labels.reshape(-1)
    keep = (labels != IGNORE_INDEX).astype(mstype.float32)
    count = ops.maximum(keep.sum(), 1.0)
    safe = ops.where(labels != IGNORE_INDEX, labels, ops.zeros_like(labels))
    if fused.ON:
        nll, residual = fused.cross_entropy(logits, safe.astype(mstype.int32))
        return (nll * keep).sum() / count, (residual, keep / count)
    logp = ops.log_softmax(logits, -1)
    picked = ops.gather_elements(logp, 1, safe.reshape(-1, 1)).reshape(-1)
    loss = -(picked * keep).sum() / count
    onehot = ops.one_hot(safe, logits.shape[-1], ops.ones((), mstype.float32), ops.zeros((), mstype.float32))
    return loss, (ops.exp(logp) - onehot, keep / count)


def cross_entropy_dx(g, saved):
    """dL/d logits [tokens, V] of the mean cross-entropy, times the loss's gradient g."""
    residual, weight = saved
    return residual * (weight * g).expand_dims(-1)


__all__ = [
    "IGNORE_INDEX",
    "attention",
    "attention_dx",
    "bias_dw",
    "cross_entropy",
    "cross_entropy_dx",
    "embedding_dw",
    "linear",
    "linear_dw",
    "linear_dx",
    "rms_norm",
    "rms_norm_dx",
    "rope",
    "rope_dx",
    "scale_dw",
    "stacked_linear_dw",
    "swiglu",
    "swiglu_dx",
]
