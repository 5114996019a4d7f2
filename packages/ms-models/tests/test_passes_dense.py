"""The explicit passes of the dense family (Llama, Qwen2: GQA attention with RoPE, SwiGLU MLP, RMSNorm,
their decoder layers) and of the pipeline blocks every family shares (token embedding, head with the
loss), compiled with mindspore.jit, give the plain module's output, input gradient and weight
gradients (ms.grad of the module in PyNative); so do the primitives of ms_models.passes.ops."""

import numpy as np
import pytest
from _passes_check import RTOL, _angles, _check, _tensor

from ms_layout.testing import assert_close

pytestmark = [pytest.mark.needs_mindspore, pytest.mark.usefixtures("kernels")]  # plain and fused

ARCHS = ("llama", "qwen2")  # qwen2: biases on q, k, v


def _model(arch, seed=3, **overrides):
    from ms_models import from_config, tiny_config
    from ms_models.tiny import randomize

    config = tiny_config(arch, tie_word_embeddings=False, **overrides)
    model = from_config(config, seed=seed)
    randomize(model, seed)  # norms away from 1 and non-zero biases: every term of the gradient shows
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_passes(arch):
    from ms_models.passes import AttentionPasses

    model = _model(arch)
    attn = model.model.layers[0].self_attn
    assert attn.num_heads > attn.num_kv_heads  # GQA: queries grouped over shared keys
    assert (attn.q_proj.bias is not None) == (arch == "qwen2")
    cos, sin, allowed = _angles(model, [list(range(7)), list(range(3, 10))])
    x = _tensor((2, 7, model.config.hidden_size), 1)
    _check(AttentionPasses(attn), attn, (x, cos, sin, allowed), (cos, sin), f"attention[{arch}]")


@pytest.mark.parametrize("arch", ARCHS)
def test_mlp_passes(arch):
    from ms_models.passes import MLPPasses

    mlp = _model(arch).model.layers[1].mlp
    x = _tensor((2, 5, mlp.gate_proj.in_features), 2)
    _check(MLPPasses(mlp), mlp, (x,), (), f"mlp[{arch}]")


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_layer_passes(arch):
    from ms_models.passes import DecoderLayerPasses

    model = _model(arch)
    layer = model.model.layers[1]
    cos, sin, allowed = _angles(model, [list(range(6))] * 2)
    x = _tensor((2, 6, model.config.hidden_size), 4)
    _check(DecoderLayerPasses(layer), layer, (x, cos, sin, allowed), (cos, sin), f"layer[{arch}]")


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_layer_passes_packed(arch):
    """Three samples packed in one row: positions restart, attention stays within each sample."""
    from ms_models.passes import DecoderLayerPasses

    model = _model(arch)
    layer = model.model.layers[0]
    positions, segments = [[0, 1, 2, 0, 1, 2, 3, 0, 1]], [[0, 0, 0, 1, 1, 1, 1, 2, 2]]
    cos, sin, allowed = _angles(model, positions, segments)
    assert not allowed.asnumpy()[0, 0, 4, 1]
    x = _tensor((1, 9, model.config.hidden_size), 5)
    _check(DecoderLayerPasses(layer), layer, (x, cos, sin, allowed), (cos, sin), f"packed layer[{arch}]")


@pytest.mark.parametrize("arch", ARCHS)
def test_pipeline_block_passes(arch):
    """Every block of ms_models.pipeline_blocks: its explicit_passes() against the block itself."""
    import mindspore as ms

    from ms_models import pipeline_blocks
    from ms_models.passes import host_ops

    model = _model(arch, seed=5)
    blocks = pipeline_blocks(model)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    ids = ms.Tensor(np.random.default_rng(0).integers(0, vocab, (2, 6)).astype(np.int32))
    x = _tensor((2, 6, hidden), 6)
    for k, block in enumerate(blocks[1:-1]):
        _check(block.explicit_passes(), block, (x,), (), f"block {k + 1}[{arch}]")
    # the embedding: no input gradient (its input is data), the table's gradient is a row scatter
    embed = blocks[0].explicit_passes()
    y, saved = embed.forward(ids)
    g = _tensor(y.shape, 7)
    _, pairs = embed.backward_input(saved, g)
    (got,) = embed.backward_weight(pairs)
    (want,) = ms.grad(blocks[0], grad_position=None, weights=embed.weights(), sens_param=True)(ids, g)
    assert_close(y.asnumpy(), blocks[0](ids).asnumpy(), 0.0, "embedding output")
    assert_close(got.asnumpy(), want.asnumpy(), RTOL, "embedding table gradient")
    (host,) = embed.backward_weight(host_ops.to_host(pairs), host_ops)  # a sorted segment sum in numpy
    assert_close(host, want.asnumpy(), RTOL, "embedding table gradient on the host")
    # the head: (hidden, labels) -> loss, with ignored labels (-100) taking no part
    labels = ids.asnumpy().copy()
    labels[0, :2] = -100
    labels = ms.Tensor(labels)
    head, block = blocks[-1].explicit_passes(), blocks[-1]
    scale = ms.Tensor(0.25, ms.float32)  # the pipeline's 1 / microbatches

    def run(x, labels, scale):
        loss, saved = head.forward(x, labels)
        dx, pairs = head.backward_input(saved, scale)
        return loss, dx, head.backward_weight(pairs), pairs

    loss, dx, dws, pairs = ms.jit(run)(x, labels, scale)
    host_dws = head.backward_weight(host_ops.to_host(pairs), host_ops)
    ref_dx, ref_dws = ms.grad(block, grad_position=0, weights=head.weights(), sens_param=True)(x, labels, scale)
    assert_close(float(loss.asnumpy()), float(block(x, labels).asnumpy()), RTOL, "head loss")
    assert_close(dx.asnumpy(), ref_dx.asnumpy(), RTOL, "head dx")
    for p, a, b in zip(head.weights(), dws, ref_dws):
        assert_close(a.asnumpy(), b.asnumpy(), RTOL, f"head d {p.name}")
    for p, a, b in zip(head.weights(), host_dws, ref_dws):
        assert_close(a, b.asnumpy(), RTOL, f"head d {p.name} on the host")


def test_rope_backward_is_the_inverse_rotation_in_both_layouts():
    """rope_dx(g) = J^T g for the rotation J of apply_rope, checked through <J x, g> = <x, J^T g>."""
    import mindspore as ms

    from ms_models.layers import apply_rope
    from ms_models.passes.ops import rope_dx

    rng = np.random.default_rng(0)
    angles = rng.uniform(0, 6.3, (2, 5, 4)).astype(np.float32)
    cos, sin = ms.Tensor(np.cos(angles)), ms.Tensor(np.sin(angles))
    x, g = (ms.Tensor(rng.standard_normal((2, 5, 3, 8)).astype(np.float32)) for _ in range(2))
    for interleave in (False, True):
        lhs = float((apply_rope(x, cos, sin, interleave) * g).sum().asnumpy())
        rhs = float((x * rope_dx(g, cos, sin, interleave)).sum().asnumpy())
        assert abs(lhs - rhs) <= 1e-5 * abs(lhs), interleave
