"""Packed sequences: positions restart per sample, no attention across samples; logits and
gradients equal those of running the samples one by one."""

import numpy as np
import pytest
from conftest import ARCHS, random_ids

from ms_layout.testing import UNIT_ROUNDOFF as U
from ms_layout.testing import assert_close
from ms_models import ModelError, packed_positions

LENGTHS = (5, 3, 8)


def test_packed_positions():
    positions, segments = packed_positions([0, 2, 5, 6])
    assert positions.tolist() == [0, 1, 0, 1, 2, 0]
    assert segments.tolist() == [0, 0, 1, 1, 1, 2]
    with pytest.raises(ModelError, match="strictly increase"):
        packed_positions([0, 3, 3])


def _samples():
    return [random_ids(1, n, seed=40 + i)[0] for i, n in enumerate(LENGTHS)]


@pytest.mark.needs_mindspore
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_logits_equal_per_sample(arch, tiny_models):
    import mindspore as ms

    model = tiny_models[arch]
    samples = _samples()
    cu = np.concatenate([[0], np.cumsum(LENGTHS)])
    packed = model.forward_packed(np.concatenate(samples), cu).asnumpy()[0]
    # the same math on other matmul shapes (16 packed rows vs one sample's): rounding relative to the
    # logits' scale; sums over <= 128 (intermediate size) in each of <= 3 layers and the head's over the
    # hidden size (64): n ~ 3 * 128 + 64 < 512 (measured here: bit-identical)
    for i, (sample, a, b) in enumerate(zip(samples, cu[:-1], cu[1:])):
        want = model(ms.Tensor(sample[None])).asnumpy()[0]
        assert_close(packed[a:b], want, 512 * U, f"sample {i} packed logits")


def _loss_fn(model, weights):
    """A loss that weighs every logit differently, so every gradient entry matters."""
    from mindspore import ops

    def loss(ids, positions, segments):
        return ops.sum(model(ids, positions, segments) * weights)

    return loss


@pytest.mark.needs_mindspore
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_gradients_equal_per_sample(arch, tiny_dirs):
    import mindspore as ms

    from ms_models import from_pretrained

    model = from_pretrained(tiny_dirs[arch])
    params = model.trainable_params()
    samples = _samples()
    total = sum(LENGTHS)
    weights = np.random.default_rng(0).normal(size=(1, total, model.config.vocab_size)).astype(np.float32)
    positions, segments = packed_positions(np.concatenate([[0], np.cumsum(LENGTHS)]))

    grad_fn = ms.value_and_grad(_loss_fn(model, ms.Tensor(weights)), None, params)
    packed_loss, packed_grads = grad_fn(
        ms.Tensor(np.concatenate(samples)[None]), ms.Tensor(positions[None]), ms.Tensor(segments[None])
    )
    loss_sum, grad_sum = 0.0, [np.zeros(p.shape, np.float32) for p in params]
    start = 0
    for sample in samples:
        n = len(sample)
        fn = ms.value_and_grad(_loss_fn(model, ms.Tensor(weights[:, start : start + n])), None, params)
        loss, grads = fn(ms.Tensor(sample[None]), ms.Tensor(np.arange(n, dtype=np.int32)[None]), None)
        loss_sum += float(loss.asnumpy())
        grad_sum = [acc + g.asnumpy() for acc, g in zip(grad_sum, grads)]
        start += n
    assert float(packed_loss.asnumpy()) == pytest.approx(loss_sum, rel=1e-4)
    assert len(packed_grads) == len(params)
    for param, got, want in zip(params, packed_grads, grad_sum):
        scale = max(np.abs(want).max(), 1e-6)
        assert np.abs(got.asnumpy() - want).max() / scale < 1e-4, param.name
    # Every trainable weight of the main model (router included) receives a gradient; the MTP
    # modules are not on the main forward path.
    silent = [p.name for p, g in zip(params, grad_sum) if not np.abs(g).max() > 0]
    assert all("mtp_layers" in name for name in silent)
