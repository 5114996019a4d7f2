"""A Cell's backward item from tensor hooks (grad_taps.py): each module's own share of its input
gradient, per call, against gradients worked out by hand."""

import json
import os

import numpy as np
import pytest

from ms_probe import PrecisionDebugger

pytestmark = pytest.mark.needs_mindspore


@pytest.fixture(scope="module")
def ms():
    import mindspore

    mindspore.set_device("CPU")
    return mindspore


def _cells(ms):
    from mindspore import nn

    class Scale(nn.Cell):
        """y = k * x: grad_input = k * grad_output."""

        def __init__(self, k):
            super().__init__()
            self.k = k

        def construct(self, x):
            return x * self.k

    class Same(nn.Cell):
        """Returns its input: its output gradient must arrive before its input's."""

        def construct(self, x):
            return x

    class TwoInputs(nn.Cell):
        """y = a * 2; b is not used: its gradient never comes."""

        def construct(self, a, b):
            return a * 2

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.shared = Scale(3.0)
            self.same = Same()
            self.two = TwoInputs()

        def construct(self, x):
            h = self.shared(x)  # call 0: dL/dh = 2 (via `two`) + 5 (residual below)
            y = self.two(self.same(h), x)
            z = self.shared(y)  # call 1: dL/dz = 1
            return z.sum() + 5 * h.sum()

    return Net()


def _backward_items(folder):
    data = json.load(open(os.path.join(folder, "dump.json")))["data"]
    return {k: v for k, v in data.items() if ".backward." in k}


def _values(records):
    return [None if r is None else (r["Max"], r["Min"]) for r in records]


def test_each_call_gets_its_own_share_of_the_input_gradient(ms, tmp_path):
    net = _cells(ms)
    x = ms.Tensor(np.ones((2, 3), np.float32))
    dbg = PrecisionDebugger(dump_path=str(tmp_path), task="statistics")
    grad_fn = ms.value_and_grad(lambda v: net(v), 0)
    with dbg.dump_step(net):
        _, dx = grad_fn(x)
    items = _backward_items(tmp_path / "step0" / "rank0")
    # backward items count in backward order: the second call of `shared` (z = 3y) is backward.0,
    # grad_output 1, grad_input 3
    assert _values(items["Cell.shared.Scale.backward.0"]["input"]) == [(1.0, 1.0)]
    assert _values(items["Cell.shared.Scale.backward.0"]["output"]) == [(3.0, 3.0)]
    # `two` (y = 2a): grad_output 3, grad_input 6 for a and None for the unused b
    assert _values(items["Cell.two.TwoInputs.backward.0"]["input"]) == [(3.0, 3.0)]
    assert _values(items["Cell.two.TwoInputs.backward.0"]["output"]) == [(6.0, 6.0), None]
    # `same` passes its gradient through
    assert _values(items["Cell.same.Same.backward.0"]["input"]) == [(6.0, 6.0)]
    assert _values(items["Cell.same.Same.backward.0"]["output"]) == [(6.0, 6.0)]
    # the first call of `shared` (h = 3x), backward.1: dL/dh sums both consumers of h (6 + 5), its
    # input's share is 3 * 11 = 33 (the same as dL/dx here: `two`'s b is unused; the next test has an
    # input also consumed outside its Cell)
    assert _values(items["Cell.shared.Scale.backward.1"]["input"]) == [(11.0, 11.0)]
    assert _values(items["Cell.shared.Scale.backward.1"]["output"]) == [(33.0, 33.0)]
    np.testing.assert_allclose(dx.asnumpy(), 33.0)


def test_an_input_also_used_outside_the_cell_gets_only_the_cells_share(ms, tmp_path):
    from mindspore import nn

    class Double(nn.Cell):
        def construct(self, x):
            return x * 2

    class Residual(nn.Cell):
        def __init__(self):
            super().__init__()
            self.inner = Double()

        def construct(self, x):
            return x + self.inner(x)  # dL/dx = 1 + 2; the inner Cell's share is 2

    net = Residual()
    x = ms.Tensor(np.ones((4,), np.float32))
    dbg = PrecisionDebugger(dump_path=str(tmp_path), task="statistics")
    with dbg.dump_step(net):
        ms.value_and_grad(lambda v: net(v).sum(), 0)(x)
    items = _backward_items(tmp_path / "step0" / "rank0")
    assert _values(items["Cell.inner.Double.backward.0"]["output"]) == [(2.0, 2.0)]
    assert _values(items["Cell.inner.Double.backward.0"]["input"]) == [(1.0, 1.0)]


def test_hooks_and_copies_are_gone_after_the_step(ms, tmp_path):
    net = _cells(ms)
    x = ms.Tensor(np.ones((2, 3), np.float32))
    grad_fn = ms.value_and_grad(lambda v: net(v), 0)
    _, before = grad_fn(x)
    dbg = PrecisionDebugger(dump_path=str(tmp_path), task="statistics")
    with dbg.dump_step(net):
        grad_fn(x)
    assert not net.shared._forward_pre_hook and not net.shared._forward_hook
    _, after = grad_fn(x)
    np.testing.assert_array_equal(before.asnumpy(), after.asnumpy())
    assert not (tmp_path / "step1").exists()
