"""MindSpore tensors as the Recorder reads them: host views (DLPack, no copy) on CPU with PyNative
synchronous, dtype names as a MindSpore dump spells them, and storage keys for the statistics cache."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np


class MindSporeAdapter:
    """MindSpore tensors for the Recorder."""

    framework = "mindspore"
    prefix = "Cell"
    type_name = "mindspore.Tensor"

    def __init__(self):
        import mindspore as ms

        self._tensor = ms.Tensor
        self._dtype = ms.dtype.Type
        self._host_view: bool | None = None  # decided at the first tensor (the context is set by then)
        self._dtype_names: dict[Any, str] = {}
        self._no_dlpack: set[Any] = set()  # dtypes MindSpore's to_dlpack refused: read with asnumpy

    def is_tensor(self, x: Any) -> bool:
        return isinstance(x, (self._tensor, np.ndarray))  # numpy: the values a compiled step's probes saw

    def to_numpy(self, x: Any) -> np.ndarray:
        """The tensor's values on the host. On CPU with synchronous PyNative, a view of the
        tensor's own memory (DLPack, no copy: `asnumpy` copies, ~2x the cost of the statistics);
        the Recorder reads it (statistics, .npy) before it returns, while the tensor is alive."""
        if self._host_view is None:
            self._host_view = _host_view_available()
        if isinstance(x, np.ndarray):
            a = x
        elif self._host_view and x.dtype not in self._no_dlpack:
            try:
                a = np.from_dlpack(_DLPack(x))
            except (BufferError, RuntimeError, TypeError, ValueError):  # bfloat16, bool, a non-CPU tensor
                # MindSpore's refusal costs ~90 us (its message carries a C++ stack): once per dtype
                self._no_dlpack.add(x.dtype)
                a = x.asnumpy()
        else:
            a = x.asnumpy()
        if _unreducible(a.dtype):
            a = a.astype(np.float32)
        return a

    def dtype_name(self, x: Any) -> str:
        if isinstance(x, np.ndarray):
            return _mindspore_dtype_name(x.dtype.str)
        name = self._dtype_names.get(x.dtype)
        if name is None:  # str() of a MindSpore dtype costs more than a dict lookup
            name = self._dtype_names[x.dtype] = str(x.dtype)
        return name

    def storage_key(self, x: Any) -> tuple | None:
        """What identifies the tensor's values now (stats_cache.py): address, shape, strides,
        dtype and version counter; a numpy array (a compiled step's probe) by its address."""
        try:
            if isinstance(x, np.ndarray):
                return (x.__array_interface__["data"][0], x.shape, x.strides, x.dtype.str)
            ptr = x.data_ptr()
            return (ptr, tuple(x.shape), tuple(x.stride()), x.dtype, x._version) if ptr else None
        except (AttributeError, RuntimeError, TypeError, ValueError):  # no address (not materialized)
            return None

    def requires_grad(self, x: Any) -> bool | None:
        return None

    def other_info(self, x: Any) -> dict[str, Any] | None:
        if isinstance(x, self._dtype):
            return {"type": "mindspore.dtype", "value": str(x)}
        return None


@functools.cache
def _unreducible(dtype: np.dtype) -> bool:
    """ml_dtypes' bfloat16 (and other void types): numpy cannot reduce it (cached: `dtype.name`
    costs microseconds a tensor)."""
    return dtype.kind == "V" or dtype.name == "bfloat16"


class _DLPack:
    """A MindSpore tensor as numpy.from_dlpack takes it (MindSpore 2.10's Tensor has to_dlpack only)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack__(self, stream=None):
        return self.tensor.to_dlpack()

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU: _host_view_available() allows CPU only


def _host_view_available() -> bool:
    """Whether tensors can be read in place: CPU, with PyNative synchronous (every op has finished
    when it returns, so the memory holds the values; set_context(pynative_synchronize=True))."""
    import mindspore as ms

    try:
        return ms.get_context("device_target") == "CPU" and bool(ms.get_context("pynative_synchronize"))
    except (ValueError, TypeError, RuntimeError):
        return False


@functools.cache
def _mindspore_dtype_name(numpy_dtype: str) -> str:
    """MindSpore's name of a numpy dtype ("<f4" -> "Float32"), as a PyNative dump spells it."""
    import mindspore as ms

    return str(ms.Tensor(np.zeros((), np.dtype(numpy_dtype))).dtype)


__all__ = ["MindSporeAdapter"]
