"""Measure what the backward keeps: the bytes of every tensor the autograd tape holds after a forward.

``SavedTensorMeter`` sits outermost in ``mindspore.saved_tensors_hooks``: every tensor an op saves for
its backward passes through its pack hook, and it adds the tensor's storage (counted once however many
ops save it, parameters excluded). Inside a recomputed Cell our own hooks take over, so the meter
sees what those keep instead: the checkpoint's inputs, which the runner reports to it.

What this measures, and what it does not: the tensors the tape holds between the forward and the
backward -- the quantity recompute trades for time and the one Megatron's formula counts. Not the
allocator's view: temporaries freed during the forward, the logits, gradient buffers and the
allocator's caching and fragmentation are not in it, so it is not the process's peak RSS (on CPU,
``ms.runtime.memory_allocated()`` reports 0 and RSS moves in allocator-sized steps). The recompute's
own transient -- recomputed tensors alive at once during the backward -- is measured separately by
the runner (``AppliedPlan.peak_working_bytes``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import mindspore as ms
from mindspore import Tensor

from .checkpoint import _STANDALONE, Runner, _storage


class SavedTensorMeter:
    """``with SavedTensorMeter(exclude=model.get_parameters(), runners=[applied.runner]) as m: forward``;
    then ``m.bytes`` is what the tape keeps for the backward."""

    def __init__(self, exclude: Iterable[Tensor] = (), runners: Iterable[Runner] = ()):
        self._excluded = {_storage(p)[0] for p in exclude}
        self._runners = [_STANDALONE, *runners]
        self.storages: dict[int, tuple[int, tuple[int, ...]]] = {}  # storage -> (bytes, a shape seen)
        self._hooks: Any = None

    def hold(self, tensors: Iterable[Tensor]) -> None:
        """Count tensors kept alive for the backward outside the tape (a checkpoint's inputs)."""
        for t in tensors:
            key, size = _storage(t)
            if key not in self._excluded:
                self.storages.setdefault(key, (size, tuple(t.shape)))

    def _pack(self, t: Tensor) -> Tensor:
        self.hold((t,))
        return t

    @property
    def bytes(self) -> int:
        """Bytes of the distinct storages kept for the backward."""
        return sum(size for size, _ in self.storages.values())

    def __enter__(self) -> SavedTensorMeter:
        for runner in self._runners:
            runner.meters.append(self)
        self._hooks = ms.saved_tensors_hooks(self._pack, _identity)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        for runner in self._runners:
            runner.meters.remove(self)


def _identity(x: Any) -> Any:
    return x
