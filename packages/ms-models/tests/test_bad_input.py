"""Hostile and careless input to the config and checkpoint readers and the `ms-models` CLI: each gives
one ModelError naming the bad value (one line and exit code 2 from the CLI), never another
exception, never a read outside the checkpoint folder, never an allocation of the size a config
claims."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from ms_models import ModelError, config_from_dict, load_config, tiny_config
from ms_models.io import MANIFEST, read_safetensors, write_manifest

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
LLAMA = tiny_config("llama").to_dict()

CONFIG_CASES = [
    ("not-an-object", [LLAMA], "a config is a JSON object of fields, not a list"),
    ("model-type-list", {**LLAMA, "model_type": ["llama"]}, "model_type ['llama'] is not supported"),
    ("vocab-text", {**LLAMA, "vocab_size": "320"}, "vocab_size='320'; expected a positive int"),
    ("vocab-bool", {**LLAMA, "vocab_size": True}, "vocab_size=True; expected a positive int"),
    ("hidden-float", {**LLAMA, "hidden_size": 64.0}, "hidden_size=64.0; expected a positive int"),
    ("kv-heads-text", {**LLAMA, "num_key_value_heads": "2"}, "num_key_value_heads='2'; expected a positive int"),
    ("head-dim-zero", {**LLAMA, "head_dim": 0}, "head_dim=0; expected a positive int"),
    ("layers-negative", {**LLAMA, "num_hidden_layers": -1}, "num_hidden_layers=-1; expected a positive int"),
    ("eps-text", {**LLAMA, "rms_norm_eps": "1e-6"}, "rms_norm_eps='1e-6'; expected a non-negative finite number"),
    ("theta-nan", {**LLAMA, "rope_theta": float("nan")}, "rope_theta=nan; expected a non-negative finite number"),
    ("tie-text", {**LLAMA, "tie_word_embeddings": "yes"}, "tie_word_embeddings='yes'; expected true or false"),
    ("act-int", {**LLAMA, "hidden_act": 5}, "hidden_act=5; expected a string"),
    ("eos-text", {**LLAMA, "eos_token_id": "</s>"}, "eos_token_id='</s>'; expected null, an int or a list"),
    ("rope-text", {**LLAMA, "rope_scaling": "linear"}, "rope_scaling='linear'; expected null or an object"),
    ("rope-no-factor", {**LLAMA, "rope_scaling": {"rope_type": "linear"}}, "needs 'factor'"),
    ("rope-factor-text", {**LLAMA, "rope_scaling": {"type": "linear", "factor": "2"}}, "factor='2'; expected a"),
    ("rope-type-list", {**LLAMA, "rope_scaling": {"rope_type": ["yarn"]}}, "rope_scaling type ['yarn']"),
    ("rope-parameters-list", {**LLAMA, "rope_parameters": [1]}, "rope_parameters=[1]; expected an object"),
    ("vocab-1e12", {**LLAMA, "vocab_size": 10**12}, "vocab_size = 1000000000000 is over the limit of 1048576"),
    ("layers-1e6", {**LLAMA, "num_hidden_layers": 10**6}, "(raise it with MS_MODELS_MAX_LAYERS=N)"),
    # every size within its own limit, the product over the parameter limit: 2 x 2^20 x 2^20 x ... > 2^40
    (
        "params-2T",
        {**LLAMA, "vocab_size": 1 << 20, "hidden_size": 1 << 20, "num_attention_heads": 4, "head_dim": 16},
        "parameters of this llama config = ",
    ),
    ("unknown-field-kept", {**LLAMA, "n_routed_experts": "x"}, None),  # not a Llama field: kept in extra
]


@pytest.mark.parametrize("data, message", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_is_one_model_error(data, message):
    if message is None:
        assert config_from_dict(data).extra["n_routed_experts"] == "x"
        return
    with pytest.raises(ModelError, match=re.escape(message)):
        config_from_dict(data)


def test_deepseek_fields_are_typed():
    data = tiny_config("deepseek_v3").to_dict()
    for key, value, message in [
        ("n_routed_experts", "8", "n_routed_experts='8'; expected a positive int"),
        ("q_lora_rank", -1, "q_lora_rank=-1; expected null or a non-negative int"),
        ("norm_topk_prob", 1, "norm_topk_prob=1; expected true or false"),
        ("n_routed_experts", 1 << 30, "n_routed_experts = 1073741824 is over the limit"),
        ("rope_scaling", {"type": "yarn", "factor": 0}, "rope_scaling factor=0; expected a positive number"),
    ]:
        with pytest.raises(ModelError, match=re.escape(message)):
            config_from_dict({**data, key: value})


# ------------------------------------------------------------------------------- fuzzed readers
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)


@FUZZ
@given(arch=st.sampled_from(["llama", "qwen2", "deepseek_v3"]), data=st.data())
def test_fuzzed_config_gives_only_model_error(arch, data):
    config = tiny_config(arch).to_dict()
    key = data.draw(st.sampled_from(sorted(config)))
    config[key] = data.draw(JSON)
    try:
        built = config_from_dict(config)
    except ModelError:
        return
    built.rope_inv_freq()  # what loads must also give its RoPE tables without another error


@FUZZ
@given(blob=st.binary(max_size=256))
def test_config_bytes_give_only_model_error(tmp_path, blob):
    (tmp_path / "config.json").write_bytes(blob)
    try:
        load_config(tmp_path)
    except ModelError:
        pass


def _checkpoint(path: Path) -> Path:
    """A small HF-style folder (config, one safetensors file, the manifest), no model built."""
    path.mkdir(parents=True)
    tiny_config("llama").save(path)
    save_file({"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 3), np.float32)}, str(path / "model.safetensors"))
    write_manifest(str(path), ["model.safetensors"])
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("good") / "ck")


def _copy(good: Path, root: Path) -> Path:
    shutil.copytree(good, root / "ck", symlinks=True)
    shutil.copy(good / "model.safetensors", root / "outside.safetensors")
    return root / "ck"


def _manifest(files) -> str:
    return json.dumps({"version": 1, "files": files})


def _entry(good: Path) -> dict:
    return json.loads((good / MANIFEST).read_text())["files"]["model.safetensors"]


READER_CASES = [
    ("manifest-not-utf8", {MANIFEST: b"\xff\xfe"}, "is not UTF-8 text (byte 0)"),
    ("manifest-truncated", {MANIFEST: b'{"files": {'}, "is not valid JSON"),
    ("manifest-list", {MANIFEST: b"[]"}, "has no 'files' object"),
    ("manifest-size-text", {MANIFEST: lambda e: _manifest({"model.safetensors": {**e, "size": "1"}})}, "size = '1'"),
    ("manifest-size-bool", {MANIFEST: lambda e: _manifest({"model.safetensors": {**e, "size": True}})}, "size = True"),
    ("manifest-sha-int", {MANIFEST: lambda e: _manifest({"model.safetensors": {**e, "sha256": 5}})}, "sha256 = 5"),
    ("manifest-entry-list", {MANIFEST: lambda e: _manifest({"model.safetensors": [1]})}, "size = None"),
    ("manifest-dotdot", {MANIFEST: lambda e: _manifest({"../outside.safetensors": e})}, "leaves its folder"),
    ("manifest-absolute", {MANIFEST: lambda e: _manifest({"/etc/hostname": e})}, "'/etc/hostname' leaves its folder"),
    ("manifest-sha-wrong", {MANIFEST: lambda e: _manifest({"model.safetensors": {**e, "sha256": "0" * 64}})}, "SHA"),
    ("index-dotdot", {"model.safetensors.index.json": b'{"weight_map": {"a": "../outside.safetensors"}}'}, "leaves"),
    ("index-absolute", {"model.safetensors.index.json": b'{"weight_map": {"a": "/dev/zero"}}'}, "'/dev/zero' leaves"),
    ("index-map-list", {"model.safetensors.index.json": b'{"weight_map": ["a"]}'}, "has no 'weight_map' object"),
    ("index-not-utf8", {"model.safetensors.index.json": b"\xff"}, "is not UTF-8 text"),
    ("symlink-out", {"link.safetensors": "../outside.safetensors"}, "'link.safetensors' resolves to"),
    ("safetensors-garbage", {"model.safetensors": b"\x08\0\0\0\0\0\0\0{}"}, "model.safetensors': Error while"),
]


@pytest.mark.parametrize("edits, message", [c[1:] for c in READER_CASES], ids=[c[0] for c in READER_CASES])
def test_bad_checkpoint_is_one_model_error(good, tmp_path, edits, message):
    ck = _copy(good, tmp_path)
    for name, value in edits.items():
        if isinstance(value, str) and name.endswith(".safetensors"):
            os.symlink(value, ck / name)
            continue
        data = value(_entry(good)) if callable(value) else value
        (ck / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    if "manifest" not in " ".join(edits) and MANIFEST not in edits:
        (ck / MANIFEST).unlink()  # a checkpoint of another tool: the index or the glob is what is read
    with pytest.raises(ModelError, match=re.escape(message)):
        read_safetensors(ck)


@FUZZ
@given(data=st.data())
def test_fuzzed_manifest_gives_only_model_error(good, tmp_path_factory, data):
    ck = tmp_path_factory.mktemp("fuzz") / "ck"
    shutil.copytree(good, ck)
    manifest = json.loads((good / MANIFEST).read_text())
    where = data.draw(st.sampled_from(["root", "files", "entry", "size", "sha256", "name"]))
    entry = manifest["files"]["model.safetensors"]
    if where == "root":
        manifest = data.draw(JSON)
    elif where == "files":
        manifest["files"] = data.draw(JSON)
    elif where == "entry":
        manifest["files"]["model.safetensors"] = data.draw(JSON)
    elif where in ("size", "sha256"):
        entry[where] = data.draw(JSON)
    else:
        manifest["files"] = {data.draw(st.text(max_size=12)): entry}
    (ck / MANIFEST).write_text(json.dumps(manifest))
    try:
        read_safetensors(ck)
    except ModelError:
        pass


# ----------------------------------------------------------------------------------- the CLI
# Importing ms_models loads MindSpore (about 4 s of CPU and 400 MB): the table runs every argv
# through the console script's __main__ in ONE subprocess, each with its own stderr and exit code.
_DRIVER = r"""
import contextlib, io, json, runpy, sys, traceback
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    sys.argv = ["ms-models", *argv]
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_module("ms_models.cli", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    out.append([code, err.getvalue()])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cli_inputs(good, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli")
    out = {"GOOD": str(good), "MISSING": str(root / "missing")}
    (root / "FILE").write_text("x")
    out["FILE"] = str(root / "FILE")
    for name, config in [
        ("LATIN1", b"\xff\xfe"),
        ("TRUNCATED", b'{"model_type": "llama", '),
        ("LIST", b"[1, 2]"),
        ("TYPO", json.dumps({**LLAMA, "hidden_size": "64"}).encode()),
        ("HUGE", json.dumps({**LLAMA, "vocab_size": 10**12, "hidden_size": 10**6}).encode()),
    ]:
        (root / name).mkdir()
        (root / name / "config.json").write_bytes(config)
        out[name] = str(root / name)
    (root / "escape").mkdir()
    escape = _copy(good, root / "escape")
    (escape / MANIFEST).write_text(_manifest({"../outside.safetensors": _entry(good)}))
    out["ESCAPE"] = str(escape)
    return out


CLI_CASES = [
    ("info-missing", ["info", "MISSING"], "no config.json at '"),
    ("info-on-a-file", ["info", "FILE"], "FILE' is not valid JSON: Expecting value at line 1"),
    ("info-not-utf8", ["info", "LATIN1"], "is not UTF-8 text (byte 0)"),
    ("info-truncated", ["info", "TRUNCATED"], "is not valid JSON"),
    ("info-list", ["info", "LIST"], "a config is a JSON object of fields, not a list"),
    ("info-wrong-type", ["info", "TYPO"], "hidden_size='64'; expected a positive int"),
    ("info-huge", ["info", "HUGE"], "vocab_size = 1000000000000 is over the limit of 1048576"),
    ("info-escape", ["info", "ESCAPE"], "'../outside.safetensors' leaves its folder"),
    ("make-tiny-on-a-file", ["make-tiny", "llama", "FILE"], "FILE' is a file, not a checkpoint folder"),
    ("make-tiny-seed", ["make-tiny", "llama", "MISSING", "--seed", "-1"], "seed=-1; expected a non-negative int"),
]


@pytest.fixture(scope="module")
def cli_results(cli_inputs) -> dict[str, tuple[int, str]]:
    argvs = [[cli_inputs.get(a, a) for a in argv] for _, argv, _ in CLI_CASES]
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(argvs)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.splitlines()[-1])
    return {case[0]: tuple(r) for case, r in zip(CLI_CASES, results)}


@pytest.mark.parametrize("name, message", [(c[0], c[2]) for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_is_one_line_and_exit_2(cli_results, name, message):
    code, stderr = cli_results[name]
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ms-models: error: ") and message in lines[0], stderr


def test_huge_config_is_refused_before_allocating(cli_inputs):
    """from_pretrained on a config of 10^12 x 10^6 embeddings (4 EB) in its own `python -m` process:
    the limit refuses it and the process stays under 1 GiB (MindSpore's import alone is ~0.4 GiB)."""
    code = "import sys; from ms_models import from_pretrained; from_pretrained(sys.argv[1])"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, cli_inputs["HUGE"]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    stderr = proc.stderr.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 1 and "ModelError: vocab_size = 1000000000000 is over the limit" in stderr, stderr
    assert usage.ru_maxrss < 1024 * 1024, f"peak RSS {usage.ru_maxrss} KiB"
    cli = subprocess.run([sys.executable, "-m", "ms_models.cli", "info", cli_inputs["HUGE"]], capture_output=True)
    assert cli.returncode == 2 and cli.stderr.decode().startswith("ms-models: error: vocab_size = 1000000000000")


def test_hub_cache_snapshot_links_into_blobs_load_and_others_do_not(good, tmp_path):
    """REPO/snapshots/REV/* -> ../../blobs/HASH is how huggingface_hub lays out a download."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for f in sorted(good.iterdir()):
        if f.name == MANIFEST:
            continue
        shutil.copy(f, repo / "blobs" / f"h{f.name}")
        os.symlink(f"../../blobs/h{f.name}", snap / f.name)
    tensors = read_safetensors(snap)
    assert sorted(tensors) == sorted(read_safetensors(good))
    shutil.copy(good / "model.safetensors", tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", snap / "extra.safetensors")
    with pytest.raises(ModelError, match="'extra.safetensors' resolves to"):
        read_safetensors(snap)
