"""Run by msrun on each node of a multi-node job: the tiny DeepSeek-V3 pipelined with ZeroBubbleV
over ms_layout.comm's gloo backend (the rank from msrun's environment), one step; each rank writes
its loss, stages and gradients (npz) and the network namespace it ran in (json)."""

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # integration_tests/_tiny.py
import _tiny

from ms_layout import comm

out_dir = Path(sys.argv[1])
group = comm.init("gloo", timeout=300)
net = _tiny.model()
runtime = _tiny.pipeline_runtime(group, net)
inputs, labels = _tiny.data(net.config.vocab_size)
result = runtime.step(inputs, labels)
np.savez(out_dir / f"rank{group.rank}.npz", **runtime.grads())
info = {
    "rank": group.rank,
    "size": group.size,
    "loss": result.loss,
    "stages": sorted(runtime.stages),
    "netns": os.readlink("/proc/self/ns/net"),
    "sched_host": comm.read_env().master_addr,
}
(out_dir / f"rank{group.rank}.json").write_text(json.dumps(info))
