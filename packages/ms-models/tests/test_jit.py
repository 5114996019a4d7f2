"""The training step compiles with mindspore.jit and gives PyNative's loss and gradients."""

import numpy as np
import pytest
from conftest import random_ids

pytestmark = pytest.mark.needs_mindspore


def test_jit_value_and_grad_equals_pynative(tiny_dirs):
    import mindspore as ms
    from mindspore import ops

    from ms_models import from_pretrained

    model = from_pretrained(tiny_dirs["deepseek_v3"])  # MLA, routed MoE and group-limited top-k
    params = model.trainable_params()
    ids = random_ids(2, 9, seed=8)
    inputs, labels = ms.Tensor(ids[:, :-1]), ms.Tensor(ids[:, 1:])

    def loss_fn(x, y):
        logits = model(x)
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    step = ms.value_and_grad(loss_fn, None, params)
    loss, grads = step(inputs, labels)
    jit_loss, jit_grads = ms.jit(step)(inputs, labels)
    assert float(jit_loss.asnumpy()) == pytest.approx(float(loss.asnumpy()), rel=1e-5)
    for param, a, b in zip(params, grads, jit_grads):
        np.testing.assert_allclose(b.asnumpy(), a.asnumpy(), rtol=1e-4, atol=1e-6, err_msg=param.name)
