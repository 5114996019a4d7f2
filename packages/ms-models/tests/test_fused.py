"""ms_models.fused: each fused CPU kernel gives what the plain MindSpore ops of ms_models.passes.ops
give (in PyNative and under mindspore.jit), the automatic rule turns them on only where it should,
and a build that cannot happen says why. The passes as a whole, on these kernels, are checked
against ms.grad by test_passes_dense.py and test_passes_deepseek.py (their "fused" runs)."""

import numpy as np
import pytest

pytestmark = pytest.mark.needs_mindspore

RTOL = 2e-6  # max|a - b| / max|b|: float32, another summation order, vectorized exp


@pytest.fixture(autouse=True)
def built():
    from ms_models import fused

    try:
        fused.build.library()
    except fused.BuildError as e:
        pytest.skip(f"fused kernels unavailable: {e}")
    yield
    fused.enable(None)


def _t(shape, seed, dtype=np.float32):
    import mindspore as ms

    return ms.Tensor(np.random.default_rng(seed).normal(0.0, 1.0, shape).astype(dtype))


def _both(fn, *args, jit=False):
    """fn(*args) with the plain ops and with the fused kernels, as numpy."""
    import mindspore as ms

    from ms_models import fused

    out = []
    for on in (False, True):
        fused.enable(on)

        def call(*xs):
            return fn(*xs)

        got = (ms.jit(call) if jit else call)(*args)
        got = got if isinstance(got, tuple) else (got,)
        out.append([g.asnumpy() for g in got])
    return out


def _close(plain, fused, what):
    for i, (a, b) in enumerate(zip(plain, fused)):
        assert a.shape == b.shape, (what, i, a.shape, b.shape)
        err = float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))
        assert err < RTOL, f"{what}[{i}]: relative error {err:.3g}"


@pytest.mark.parametrize("jit", [False, True])
def test_rms_norm_and_its_gradients(jit):
    from ms_models.passes import ops as P

    x, w, g = _t((3, 5, 64), 0), _t((64,), 1), _t((3, 5, 64), 2)

    def norm(x, w):
        return P.rms_norm(x, w, 1e-6)

    plain, fused = _both(norm, x, w, jit=jit)
    _close(plain, fused, "rms_norm")
    import mindspore as ms

    normed, inv = ms.Tensor(plain[1]), ms.Tensor(plain[2])
    _close(*_both(P.rms_norm_dx, g, w, normed, inv, jit=jit), "rms_norm_dx")
    _close(*_both(P.scale_dw, normed, g, jit=jit), "scale_dw")


@pytest.mark.parametrize("jit", [False, True])
def test_swiglu_and_its_gradient(jit):
    from ms_models.passes import ops as P

    gate, up, g = _t((4, 7, 96), 3), _t((4, 7, 96), 4), _t((4, 7, 96), 5)
    _close(*_both(P.swiglu, gate, up, jit=jit), "swiglu")
    _close(*_both(P.swiglu_dx, g, gate, up, jit=jit), "swiglu_dx")


@pytest.mark.parametrize("interleave", [False, True])
def test_rope_and_its_inverse_in_both_layouts(interleave):
    from ms_models.passes import ops as P

    x, cos, sin = _t((2, 6, 3, 16), 6), _t((2, 6, 8), 7), _t((2, 6, 8), 8)

    def rope(x, c, s):
        return P.rope(x, c, s, interleave)

    def rope_dx(x, c, s):
        return P.rope_dx(x, c, s, interleave)

    _close(*_both(rope, x, cos, sin, jit=True), "rope")
    _close(*_both(rope_dx, x, cos, sin, jit=True), "rope_dx")


@pytest.mark.parametrize("mask_rows", [1, 2])
def test_attention_with_grouped_heads_and_its_gradient(mask_rows):
    """GQA (4 query heads over 2 kv heads); one causal mask for the batch, or one per row with a
    row that allows nothing (the plain softmax over equal -1e30 is uniform; so is the kernel's)."""
    import mindspore as ms

    from ms_models.passes import ops as P

    n, s, d = 2, 5, 8
    q, k, v = _t((n, s, 4, d), 9), _t((n, s, 2, d), 10), _t((n, s, 2, d), 11)
    allowed = np.tril(np.ones((s, s), bool))[None, None].repeat(mask_rows, 0)
    if mask_rows == 2:
        allowed[1, 0, 2] = False  # query 2 of row 1 sees nothing
    allowed = ms.Tensor(allowed)

    def attention(q, k, v, a):
        return P.attention(q, k, v, a, 0.3)[0]

    def attention_dx(g, qf, k4, v4, probs):
        return P.attention_dx(g, (qf, k4, v4, probs), 0.3, 4)

    _close(*_both(attention, q, k, v, allowed, jit=True), "attention")
    _, saved = P.attention(q, k, v, allowed, 0.3)
    _close(*_both(attention_dx, _t((n, s, 4 * d), 12), *saved, jit=True), "attention_dx")


def test_cross_entropy_with_ignored_labels():
    import mindspore as ms

    from ms_models.passes import ops as P

    logits = _t((2, 6, 50), 13)
    labels = np.random.default_rng(14).integers(0, 50, (2, 6)).astype(np.int32)
    labels[0, :2] = P.IGNORE_INDEX

    def loss(x, y):
        value, (residual, weight) = P.cross_entropy(x, y)
        return value, residual, weight

    _close(*_both(loss, logits, ms.Tensor(labels), jit=True), "cross_entropy")


def test_a_label_outside_the_vocabulary_gives_nan_not_a_stray_read():
    import mindspore as ms

    from ms_models import fused
    from ms_models.passes import ops as P

    fused.enable(True)
    loss, _ = P.cross_entropy(_t((1, 3, 10), 15), ms.Tensor(np.array([[1, 10, 2]], np.int32)))
    assert np.isnan(loss.asnumpy())


def test_other_dtypes_take_the_plain_ops():
    from ms_models.passes import ops as P

    gate, up = _t((3, 8), 16, np.float16), _t((3, 8), 17, np.float16)
    plain, fused = _both(P.swiglu, gate, up, jit=True)
    assert np.array_equal(plain[0], fused[0])  # the same ops, bit for bit


def test_automatic_rule(monkeypatch):
    import mindspore as ms

    from ms_models import fused

    threads = ms.get_context("runtime_num_threads")
    try:
        ms.set_context(runtime_num_threads=2)
        assert fused.enable(None) is False and "runtime_num_threads=2" in fused.why_not()
        monkeypatch.setenv(fused.ENV, "1")
        assert fused.refresh() is True and fused.why_not() is None
        ms.set_context(runtime_num_threads=1)
        monkeypatch.setenv(fused.ENV, "0")
        assert fused.refresh() is False and fused.why_not() == f"{fused.ENV}=0"
        monkeypatch.delenv(fused.ENV)
        assert fused.refresh() is True
        assert fused.enable(False) is False  # an explicit choice wins
    finally:
        ms.set_context(runtime_num_threads=threads)


def test_the_build_is_cached_and_a_failing_compiler_is_named(monkeypatch, tmp_path):
    from ms_models.fused import build

    monkeypatch.setenv("MS_MODELS_CACHE", str(tmp_path))
    first = build.library()
    mtime = first.stat().st_mtime_ns
    assert build.library() == first and first.stat().st_mtime_ns == mtime  # not built again
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.raises(build.BuildError, match="false"):
        build.library()
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == [first.name]  # no half-written file
