"""What the tests of ms_models.passes share: run a passes Cell compiled, compare it with ms.grad."""

import numpy as np

from ms_layout.testing import assert_close

RTOL = 1e-5  # max|a - b| / max|b|: the same float32 math, summed in another order


def _tensor(shape, seed, scale=1.0):
    import mindspore as ms

    return ms.Tensor((np.random.default_rng(seed).normal(0.0, scale, shape)).astype(np.float32))


def _angles(model, positions, segment_ids=None):
    import mindspore as ms

    from ms_models.layers import causal_mask

    positions = ms.Tensor(np.asarray(positions, np.int32))
    cos, sin = model.model.rotary_emb(positions)
    seg = None if segment_ids is None else ms.Tensor(np.asarray(segment_ids, np.int32))
    return cos, sin, causal_mask(positions, seg)


def _run_passes(passes, args, bwd_args, g_seed=11):
    """forward, backward_input and backward_weight, each compiled with ms.jit, and backward_weight
    again on the host (numpy kernels on the same pairs) -> (y, g, dx, dws, host_dws)."""
    import mindspore as ms

    def forward(*xs):
        return passes.forward(*xs)

    def backward_input(saved, g, *xs):
        return passes.backward_input(saved, g, *xs)

    def backward_weight(pairs):
        return passes.backward_weight(pairs)

    y, saved = ms.jit(forward)(*args)
    g = _tensor(y.shape, g_seed)
    dx, pairs = ms.jit(backward_input)(saved, g, *bwd_args)
    dws = ms.jit(backward_weight)(pairs)
    from ms_models.passes import host_ops

    return y, g, dx, dws, passes.backward_weight(host_ops.to_host(pairs), host_ops)


def _check(passes, module, args, bwd_args, what):
    """Compare the passes with the module and ms.grad of it; returns the largest relative error."""
    import mindspore as ms

    weights = passes.weights()
    assert all(p.requires_grad for p in weights), what
    assert len({id(p) for p in weights}) == len(weights), f"{what}: a weight listed twice"
    module_ids = {id(p) for p in module.trainable_params()}
    assert {id(p) for p in weights} == module_ids, f"{what}: weights() is not the module's trainable set"
    y, g, dx, dws, host_dws = _run_passes(passes, args, bwd_args)
    ref_y = module(*args)
    ref_dx, ref_dws = ms.grad(module, grad_position=0, weights=weights, sens_param=True)(*args, g)
    assert len(dws) == len(host_dws) == len(weights), what
    worst = 0.0
    pairs = [("output", y, ref_y), ("dx", dx, ref_dx)]
    pairs += [(f"d {p.name} {tuple(p.shape)}", a, b) for p, a, b in zip(weights, dws, ref_dws)]
    pairs += [(f"host d {p.name} {tuple(p.shape)}", a, b) for p, a, b in zip(weights, host_dws, ref_dws)]
    for name, a, b in pairs:
        a, b = np.asarray(a if isinstance(a, np.ndarray) else a.asnumpy()), b.asnumpy()
        assert a.shape == b.shape, f"{what} {name}: shape {a.shape}, expected {b.shape}"
        assert np.abs(b).max() > 0, f"{what} {name}: the reference is all zero, the check would be empty"
        assert_close(a, b, RTOL, f"{what} {name}")
        worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
    print(f"{what}: max relative error {worst:.3g} over output, dx and {len(weights)} weight gradients")
    return worst
