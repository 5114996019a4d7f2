"""train_tiny: a short real training run lowers the loss (main and MTP) and writes a checkpoint
that loads back and scores the same held-out text."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from ms_models import ModelError


def test_corpus_is_seeded_and_encodable():
    from ms_models.tiny import build_tokenizer
    from ms_models.train_tiny import corpus_text

    assert corpus_text(3, 50) == corpus_text(3, 50) != corpus_text(4, 50)
    ids = build_tokenizer(320).encode(corpus_text(0, 200)).ids
    assert max(ids) < 320 and len(ids) > 1000


def test_deepseek_trains_and_reloads(tmp_path):
    from mindspore import Tensor, ops

    from ms_models import from_pretrained
    from ms_models.tiny import build_tokenizer
    from ms_models.train_tiny import corpus_text, train_tiny

    report = train_tiny("deepseek_v3", tmp_path / "ds", steps=40, batch=8, seq_len=32)
    assert report["final_loss"] < 0.6 * report["first_loss"], report
    assert json.loads((tmp_path / "ds" / "training.json").read_text())["steps"] == 40
    model = from_pretrained(tmp_path / "ds")  # the manifest and tokenizer are in place
    ids = np.asarray(build_tokenizer(320).encode(corpus_text(0)).ids[-200:], np.int32)[None]
    logits = model(Tensor(ids[:, :-1]))
    loss = float(ops.cross_entropy(logits.reshape(-1, 320), Tensor(ids[0, 1:])).asnumpy())
    assert loss < 0.6 * report["first_loss"]  # the written weights are the trained ones


def test_bad_arguments_are_named(tmp_path):
    from ms_models.train_tiny import train_tiny

    with pytest.raises(ModelError, match="steps=0"):
        train_tiny("llama", tmp_path / "x", steps=0)
    with pytest.raises(ModelError, match="seq_len=300"):
        train_tiny("llama", tmp_path / "x", seq_len=300)
    assert not (tmp_path / "x").exists()


def test_cli_set_overrides_fields(tmp_path, capsys):
    """`ms-models train-tiny --set FIELD=VALUE`: bad forms are named; a field the config lacks too."""
    from ms_models.cli import main

    for bad, message in (("hidden_size", "expected FIELD=VALUE"), ("hidden_size=wide", "not a JSON value"),
                         ("hidden=256", "no fields \\['hidden'\\]")):  # fmt: skip
        assert main(["train-tiny", "llama", str(tmp_path / "x"), "--steps", "1", "--set", bad]) == 2
        assert re.search(message, capsys.readouterr().err), bad
    assert not (tmp_path / "x").exists()
