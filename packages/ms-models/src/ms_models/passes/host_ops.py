"""The weight-gradient kernels of :mod:`.ops` in numpy, for running the W pass on the host's BLAS.

Every ``backward_weight(pairs, k=ops)`` of the passes takes its kernels as ``k``: under
``mindspore.jit`` they are :mod:`.ops` (MindSpore ops in the compiled graph); with ``k=host_ops``
and the pairs as numpy arrays, the same method computes the same gradients with numpy.

Why: on CPU, MindSpore's ``MatMul`` on a W pass's stored pairs ran at 18-36 GFLOP per core-second
(a stage of two d=256 Llama layers: 42-85 ms, varying with where its memory pool placed the
pairs), while OpenBLAS through numpy did the same 14 GEMMs in 20-24 ms on the same arrays, read
in place (``Tensor.asnumpy()`` shares the CPU tensor's memory). The kernels are the textbook ones:
``dW = g^T x`` over every leading dimension, sums for biases and scales, a sorted segment sum for an
embedding table.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mindspore import dtype as mstype


def to_host(tree: Any) -> Any:
    """Nested tuples of MindSpore CPU tensors as the same tuples of numpy arrays, sharing memory
    where the dtype allows (float32 and integers); other float dtypes (bfloat16) become float32."""
    if isinstance(tree, (tuple, list)):
        return tuple(to_host(t) for t in tree)
    if tree is None or isinstance(tree, np.ndarray):
        return tree
    if tree.dtype == mstype.bfloat16:
        tree = tree.astype(mstype.float32)
    return tree.asnumpy()


def _flat(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, x.shape[-1])


def linear_dw(x: np.ndarray, g: np.ndarray) -> np.ndarray:
    """dL/dW = g^T x summed over every leading dim: x [..., in], g [..., out] -> [out, in]."""
    return _flat(g).T @ _flat(x)


def bias_dw(g: np.ndarray) -> np.ndarray:
    """dL/db = sum of g over every leading dim."""
    return _flat(g).sum(0)


def scale_dw(normed: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Gradient of an elementwise scale ``y = w * normed``: sum(normed * g) over leading dims."""
    return _flat(normed * g).sum(0)


def stacked_linear_dw(x: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Per-expert dL/dW of ``y[e] = x[e] W[e]^T``: x [E, M, in], g [E, M, out] -> [E, out, in]."""
    return np.matmul(g.transpose(0, 2, 1), x)


def embedding_dw(ids: np.ndarray, g: np.ndarray, vocab: int) -> np.ndarray:
    """dL/d(table) of a row lookup: each token's gradient added to its row, [vocab, hidden]."""
    ids, g = ids.reshape(-1), _flat(g)
    order = np.argsort(ids, kind="stable")
    rows, starts = np.unique(ids[order], return_index=True)
    out = np.zeros((vocab, g.shape[-1]), dtype=g.dtype)
    out[rows] = np.add.reduceat(g[order], starts, axis=0)  # np.add.at took 260 ms for 512 x 256
    return out


__all__ = ["bias_dw", "embedding_dw", "linear_dw", "scale_dw", "stacked_linear_dw", "to_host"]
