"""A ``mindspore.train.Callback`` that feeds a Monitor from ``Model.train``.

    model.train(epochs, dataset, callbacks=[MonitorCallback(tokens_per_sample=seq_len)])

Step numbers are MindSpore's ``cur_step_num`` (from 1, across epochs). Throughput uses the
dataset's batch size when ``samples_per_step`` is not given. Phase ranges do not exist here:
``Model`` runs forward, backward and the optimizer as one compiled step; use the Monitor API in a
custom loop for phases. On-demand traces work as with the Monitor API.
"""

from __future__ import annotations

from typing import Any

from mindspore.train import Callback

from .agent import Monitor


class MonitorCallback(Callback):
    """Times every training step of ``Model.train`` and ships it to the ms-monitor daemon."""

    def __init__(
        self,
        monitor: Monitor | None = None,
        *,
        samples_per_step: int | None = None,
        tokens_per_sample: int | None = None,
        **monitor_kwargs: Any,
    ):
        super().__init__()
        self.monitor = monitor or Monitor(**monitor_kwargs)
        self.samples_per_step = samples_per_step
        self.tokens_per_sample = tokens_per_sample

    def on_train_begin(self, run_context: Any) -> None:
        if self.samples_per_step is None:
            dataset = getattr(run_context.original_args(), "train_dataset", None)
            try:
                self.samples_per_step = int(dataset.get_batch_size()) if dataset is not None else None
            except Exception:
                self.samples_per_step = None

    def on_train_step_begin(self, run_context: Any) -> None:
        self.monitor.begin_step(run_context.original_args().cur_step_num)

    def on_train_step_end(self, run_context: Any) -> None:
        smp = self.samples_per_step
        tok = smp * self.tokens_per_sample if smp is not None and self.tokens_per_sample is not None else None
        self.monitor.end_step(tokens=tok, samples=smp)

    def on_train_end(self, run_context: Any) -> None:
        self.monitor.close()
