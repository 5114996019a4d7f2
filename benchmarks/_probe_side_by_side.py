"""Two ms-probe versions' statistics dumps side by side in one process, on bench_probe's model.

    git archive OLD_COMMIT packages/ms-probe/src | tar -x -C /tmp/old
    OMP_NUM_THREADS=1 python benchmarks/_probe_side_by_side.py /tmp/old/packages/ms-probe/src [--reps 25]

The older package is copied under the name `ms_probe_old` (its modules import each other
relatively), both debuggers dump the same MindSpore step, and each repetition runs the step without
dump, the old dump and the new one, the order reversed every other repetition, so that the load of a
shared box falls on the three alike. Prints the medians' ratios to the step without dump (wall
clock, process CPU, main-thread CPU: the hooks run there) and whether the last step's dump.json of
both versions are equal.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_probe import SMALL


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old_src", type=Path, help="a src/ folder holding an older ms_probe package")
    ap.add_argument("--reps", type=int, default=25)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="probe_sbs_"))
    try:
        shutil.copytree(args.old_src / "ms_probe", work / "pkg" / "ms_probe_old")
        sys.path.insert(0, str(work / "pkg"))
        import mindspore as ms
        import ms_probe_old

        import ms_probe
        from ms_models import from_pretrained, make_tiny

        ms.set_device("CPU")
        ms.set_context(pynative_synchronize=True)
        model = from_pretrained(make_tiny("llama", work / "model", seed=0, **SMALL))
        grad_fn = ms.value_and_grad(lambda x: model(x).mean(), None, model.trainable_params())
        ids = ms.Tensor(np.random.default_rng(0).integers(4, 300, (4, 64)).astype(np.int32))

        def step():
            grad_fn(ids)[1][0].asnumpy()

        debuggers = {
            "old": ms_probe_old.PrecisionDebugger(dump_path=str(work / "old"), task="statistics"),
            "new": ms_probe.PrecisionDebugger(dump_path=str(work / "new"), task="statistics"),
        }

        def dumped(which):
            def run():
                with debuggers[which].dump_step(model):
                    step()

            return run

        fns = {"none": step, "old": dumped("old"), "new": dumped("new")}
        for fn in fns.values():
            fn()  # warm-up
        clocks = {"wall": time.perf_counter, "cpu": time.process_time, "main thread cpu": time.thread_time}
        times = {c: {k: [] for k in fns} for c in clocks}
        load = os.getloadavg()[0]
        for i in range(args.reps):
            for k in list(fns) if i % 2 == 0 else list(fns)[::-1]:
                start = {c: f() for c, f in clocks.items()}
                fns[k]()
                for c, f in clocks.items():
                    times[c][k].append(f() - start[c])
        print(f"{args.reps} repetitions, load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
        for c in clocks:
            med = {k: statistics.median(v) for k, v in times[c].items()}
            print(
                f"{c:>16}: no dump {med['none'] * 1e3:.1f} ms; old {med['old'] / med['none']:.3f}x "
                f"(+{(med['old'] - med['none']) * 1e3:.1f} ms), new {med['new'] / med['none']:.3f}x "
                f"(+{(med['new'] - med['none']) * 1e3:.1f} ms)"
            )
        last = f"step{args.reps}"
        data = [json.loads((work / v / last / "rank0" / "dump.json").read_text())["data"] for v in ("old", "new")]
        print(f"last step's dump.json equal: {data[0] == data[1]} ({len(data[1])} items)")
        for dbg in debuggers.values():
            dbg.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
