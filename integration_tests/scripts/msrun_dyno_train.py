"""An unmodified MindSpore data-parallel script (run by msrun): communication init, a Dense layer
trained with an all-reduce of its gradients, and MindSpore's DynamicProfilerMonitor stepped each
iteration. With MSMONITOR_USE_DAEMON=1 MindSpore talks to the ms-monitor daemon through IPCMonitor.

Arguments: the most steps to run, the profiler's output folder, and optionally a stop file: once
rank 0 sees it, every rank stops after the same step (its flag is all-reduced with the gradients'
all-reduce op), so a test can keep the job running for as long as it needs instead of racing a
fixed number of steps."""

import os
import sys
import time

import mindspore as ms
import numpy as np
from mindspore import nn, ops
from mindspore.communication import get_group_size, get_rank, init
from mindspore.profiler import DynamicProfilerMonitor

steps, out_dir = int(sys.argv[1]), sys.argv[2]
stop_file = sys.argv[3] if len(sys.argv) > 3 else None
ms.set_device("CPU")
init()
rank, size = get_rank(), get_group_size()
net = nn.Dense(16, 16)
opt = nn.SGD(net.trainable_params(), learning_rate=0.01)
loss_fn = nn.MSELoss()
allreduce = ops.AllReduce()


def forward(x, y):
    return loss_fn(net(x), y)


grad_fn = ms.value_and_grad(forward, None, opt.parameters)
rng = np.random.default_rng(rank)
x = ms.Tensor(rng.standard_normal((8, 16)).astype(np.float32))
y = ms.Tensor(rng.standard_normal((8, 16)).astype(np.float32))
dp = DynamicProfilerMonitor(output_path=out_dir, poll_interval=1)
for _ in range(steps):
    loss, grads = grad_fn(x, y)
    grads = tuple(allreduce(g) / size for g in grads)
    opt(grads)
    loss.asnumpy()
    time.sleep(0.03)
    dp.step()
    if stop_file is not None:
        stop = ms.Tensor([float(rank == 0 and os.path.exists(stop_file))], ms.float32)
        if float(allreduce(stop).asnumpy()[0]) > 0:
            break
print(f"rank {rank} done", flush=True)
