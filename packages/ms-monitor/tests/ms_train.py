"""Tiny MindSpore training steps for the tests (a Dense layer, Adam, one jitted step)."""

from __future__ import annotations

import numpy as np


def make_step(seed: int = 0, dim: int = 32):
    import mindspore as ms
    from mindspore import nn

    ms.set_device("CPU")
    ms.set_seed(seed)
    net = nn.Dense(dim, dim)
    opt = nn.Adam(net.trainable_params())
    loss_fn = nn.MSELoss()

    def forward(x, y):
        return loss_fn(net(x), y)

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)

    @ms.jit
    def train_step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss

    rng = np.random.default_rng(seed)
    x = ms.Tensor(rng.standard_normal((16, dim)).astype(np.float32))
    y = ms.Tensor(rng.standard_normal((16, dim)).astype(np.float32))
    return lambda: float(train_step(x, y).asnumpy())
