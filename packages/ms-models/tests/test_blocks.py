"""pipeline_blocks: the chained blocks compute the model's own loss, with the HF names kept."""

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import ops  # noqa: E402

import ms_models  # noqa: E402

pytestmark = pytest.mark.needs_mindspore


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_chained_blocks_give_the_models_loss_and_keep_hf_names(arch):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    model = ms_models.from_config(ms_models.tiny_config(arch), seed=0)
    names = {p.name for p in model.get_parameters()}
    blocks = ms_models.pipeline_blocks(model)
    assert len(blocks) == model.config.num_hidden_layers + 2
    ids = ms.Tensor(np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 7)), ms.int32)
    x, labels = ids[:, :-1], ids[:, 1:]
    for block in blocks[:-1]:
        x = block(x)
    loss = blocks[-1](x, labels).asnumpy()
    logits = model(ids[:, :-1])
    want = ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).asnumpy()
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    block_names = {p.name for b in blocks for p in b.get_parameters()}
    assert block_names <= names and "model.embed_tokens.weight" in block_names and "lm_head.weight" in block_names


def test_a_tied_head_is_refused():
    config = ms_models.tiny_config("llama")
    config.tie_word_embeddings = True
    model = ms_models.from_config(config, seed=0)
    with pytest.raises(ms_models.ModelError, match="tie_word_embeddings"):
        ms_models.pipeline_blocks(model)
