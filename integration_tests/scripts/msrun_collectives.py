"""Run by msrun on each worker: ms_layout.comm from msrun's environment, one all_reduce and one
all_gather, each rank's result written as JSON for the test to check."""

import json
import sys
from pathlib import Path

import numpy as np

from ms_layout import comm

backend, out_dir = sys.argv[1], Path(sys.argv[2])
group = comm.init(backend, timeout=120)
x = np.full(4, group.rank + 1.0, dtype=np.float32)
group.all_reduce(x)
gathered = group.all_gather(np.array([group.rank * 10.0], dtype=np.float32))
env = comm.read_env()
result = {
    "rank": group.rank,
    "size": group.size,
    "launcher": env.launcher,
    "sum": x.tolist(),
    "gathered": gathered.tolist(),
}
(out_dir / f"rank{group.rank}.json").write_text(json.dumps(result))
