"""Hostile and careless input: damaged manifests, plans from bytes, bad flags. Each gives one
ReshardError naming the bad value (one line and exit code 2 from the CLI), never another exception,
never a read outside the checkpoint folder, never an allocation of the size a file claims."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_llama import llama_shapes, random_weights

from ms_layout import ParallelConfig
from ms_reshard import ReshardError, format_plan, model_plan, param_specs, plan, validate
from ms_reshard.checkpoint import load_checkpoint, load_manifest, save_checkpoint, verify
from ms_reshard.serialize import (
    model_plan_from_dict,
    model_plan_to_dict,
    plan_from_bytes,
    plan_from_dict,
    plan_to_bytes,
    plan_to_dict,
)

P = "lm_head.weight"  # [64, 16], split over tp=2 along dim 0: 32 rows on each rank
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A verified tp=2 checkpoint of a one-layer tiny Llama."""
    path = tmp_path_factory.mktemp("good") / "ck"
    shapes = llama_shapes(1)
    weights = random_weights(shapes)
    specs = param_specs(shapes, ParallelConfig(tp=2), num_layers=1)
    shards = {n: {r: weights[n][s.layout.global_slice(s.shape, r)] for r in s.layout.ranks} for n, s in specs.items()}
    save_checkpoint(path, specs, shards, config=ParallelConfig(tp=2), model={"num_layers": 1})
    return path


def _edited(good: Path, root: Path, edit) -> Path:
    """A copy of `good` under `root` whose manifest `edit(manifest, root)` changed."""
    ck = root / "ck"
    shutil.copytree(good, ck)
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest = edit(manifest, root) or manifest
    (ck / "manifest.json").write_text(json.dumps(manifest))
    return ck


def _set(path: str, value):
    """An edit that sets manifest[a][b]... (path "params/lm_head.weight/shape") to `value`."""

    def edit(m, _root):
        keys = path.split("/")
        node = m
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value(m) if callable(value) else value

    return edit


def _outside(m, root: Path) -> Path:
    # rank 0's real file copied out of the checkpoint: a manifest naming it verifies if followed
    out = root / "outside.safetensors"
    shutil.copy(root / "ck" / m["files"]["0"]["path"], out)
    return out


def _path_to(name_of):
    def edit(m, root):
        out = _outside(m, root)
        m["files"]["0"]["path"] = name_of(out, root)

    return edit


def _symlink_out(m, root):
    out = _outside(m, root)
    os.symlink(out, root / "ck" / "link.safetensors")
    m["files"]["0"]["path"] = "link.safetensors"


def _subdir(m, root):
    (root / "ck" / "sub").mkdir()
    m["files"]["0"]["path"] = "sub"


MANIFEST_CASES = [
    ("version-bool", _set("version", True), "version = True; expected an int in 1..1"),
    ("version-future", _set("version", 2), "version = 2; expected an int in 1..1"),
    ("version-text", _set("version", "1"), "version = '1'; expected an int in 1..1"),
    ("format", _set("format", "pickle"), "format = 'pickle'; expected 'ms-reshard-checkpoint'"),
    ("not-an-object", lambda m, r: [m], "holds a JSON list, expected an object"),
    ("params-list", _set("params", []), "params = []; expected an object"),
    ("shape-negative", _set(f"params/{P}/shape", [64, -16]), "shape = [64, -16] must be a list of non-negative ints"),
    ("shape-float", _set(f"params/{P}/shape", [64.0, 16]), "shape = [64.0, 16] must be a list of non-negative ints"),
    ("shape-bool", _set(f"params/{P}/shape", [True, 16]), "shape = [True, 16] must be a list of non-negative ints"),
    ("shape-text", _set(f"params/{P}/shape", "64,16"), "shape = '64,16' must be a list of non-negative ints"),
    ("shape-1EiB", _set(f"params/{P}/shape", [1 << 30, 1 << 28]), "is over the limit of 1099511627776 bytes"),
    ("shape-ndim", _set(f"params/{P}/shape", [1] * 33), "dims of"),
    ("shape-vs-layout", _set(f"params/{P}/shape", [64, 16, 1]), "layout has 2 dims for shape [64, 16, 1]"),
    ("shape-not-divisible", _set(f"params/{P}/shape", [63, 16]), "layout cannot hold shape [63, 16]"),
    # 4 GiB claimed (under the limit) by a file of a few KB: refused before anything is allocated
    ("shape-beyond-file", _set(f"params/{P}/shape", [1 << 26, 16]), "10032, but the shards it lists need 2147490496"),
    ("dtype-unknown", _set(f"params/{P}/dtype", "complex64"), "dtype = 'complex64'; expected one of"),
    ("dtype-bfloat16", _set(f"params/{P}/dtype", "bfloat16"), "dtype = 'bfloat16'; expected one of"),
    ("dtype-int", _set(f"params/{P}/dtype", 4), "dtype = 4; expected one of"),
    ("layout-missing", _set(f"params/{P}/layout", None), "layout = None; expected a layout object"),
    ("layout-axis", _set(f"params/{P}/layout/dims", [["xx"], []]), "unknown alias 'xx'"),
    ("layout-dims-text", _set(f"params/{P}/layout/dims", "tp"), "layout.dims = 'tp'; expected a list of lists"),
    ("layout-mesh-1e9", _set(f"params/{P}/layout/device_matrix", [1, 1, 10**9]), "MS_RESHARD_MAX_RANKS"),
    ("layout-mesh-bool", _set(f"params/{P}/layout/device_matrix", [1, 1, True]), "sizes must be positive ints"),
    ("layout-rank-1e12", _set(f"params/{P}/layout/rank_list", [0, 10**12]), "highest rank of"),
    ("layout-rank-negative", _set(f"params/{P}/layout/rank_list", [0, -1]), "rank_list = [0, -1]; expected null"),
    ("parts-one", _set(f"params/{P}/parts", [64]), "parts = [64]; expected absent, or a list of 2+"),
    ("parts-sum", _set(f"params/{P}/parts", [30, 30]), "parts [30, 30] do not add up to shape[0] = 64"),
    ("part-dim-bool", _set(f"params/{P}/part_dim", True), "part_dim = True; expected an int in 0..1"),
    ("model-layers-text", _set("model/num_layers", "1"), "model.num_layers = '1'; expected a positive int"),
    ("model-layers-1e9", _set("model/num_layers", 10**9), "MS_RESHARD_MAX_LAYERS"),
    ("config-list", _set("config", [2]), "config = [2]; expected null or a ParallelConfig object"),
    ("files-key", lambda m, r: m.update(files={"x": m["files"]["0"]}), "files key = 'x'; expected a rank number"),
    ("files-key-zero-padded", lambda m, r: m["files"].update({"00": m["files"].pop("0")}), "files key = '00'"),
    ("file-bytes-text", _set("files/0/bytes", "18752"), "files['0'].bytes = '18752'; expected a non-negative int"),
    ("file-bytes-small", _set("files/0/bytes", 10), "files['0'].bytes = 10, but the shards it lists need"),
    ("file-sha-short", _set("files/0/sha256", "abc"), "files['0'].sha256 = 'abc'; expected 64 lowercase hex"),
    ("file-path-int", _set("files/0/path", 5), "files['0'].path = 5; expected a file name"),
    ("file-tensor-extra", _set("files/0/tensors", lambda m: [*m["files"]["0"]["tensors"], "x"]), "lists 'x', which"),
    ("file-tensor-missing", _set("files/0/tensors", []), "files['0'].tensors omits"),
    ("file-rank-missing", lambda m, r: m["files"].pop("1") and None, "is placed on rank 1, which has no entry"),
    ("path-dotdot", _path_to(lambda out, root: "../outside.safetensors"), "'../outside.safetensors' leaves its folder"),
    ("path-absolute", _path_to(lambda out, root: str(out)), "outside.safetensors' leaves its folder"),
    ("path-symlink-out", _symlink_out, "'link.safetensors' resolves to"),
    ("path-missing", _set("files/0/path", "nope.safetensors"), "nope.safetensors' does not exist"),
    ("path-folder", _subdir, "ck/sub' is not a regular file"),
    ("sha-mismatch", _set("files/0/sha256", "0" * 64), "is corrupted: its sha256 does not match the manifest"),
    ("bytes-mismatch", _set("files/0/bytes", lambda m: m["files"]["0"]["bytes"] + 1), "; the manifest says"),
]


@pytest.mark.parametrize("edit, message", [c[1:] for c in MANIFEST_CASES], ids=[c[0] for c in MANIFEST_CASES])
def test_bad_manifest_is_one_reshard_error(good, tmp_path, edit, message):
    ck = _edited(good, tmp_path, edit)
    with pytest.raises(ReshardError, match=re.escape(message)):
        verify(ck, load_manifest(ck))
        load_checkpoint(ck)


def test_file_header_must_match_the_manifest(good, tmp_path):
    # bytes and sha256 agree with the rewritten file; its header says lm_head is [48, 16], not [32, 16]
    def edit(m, root):
        from safetensors.numpy import load_file, save_file

        from ms_layout.files import file_entry

        path = root / "ck" / m["files"]["0"]["path"]
        tensors = {**load_file(str(path)), P: np.zeros((48, 16), np.float32)}
        save_file(tensors, str(path))
        m["files"]["0"].update(file_entry(path))

    ck = _edited(good, tmp_path, edit)
    with pytest.raises(ReshardError, match=re.escape("holds 'lm_head.weight' as float32[48, 16]; the manifest says")):
        load_checkpoint(ck)
    args = ["checkpoint", str(ck), str(tmp_path / "out"), "--dst-config", "tp=1", "--json"]
    line = _cli_error(args)
    assert "holds 'lm_head.weight' as F32[48, 16]; the manifest says F32[32, 16]" in line, line
    assert not (tmp_path / "out").exists()


def test_manifest_not_a_folder_not_utf8_not_json(good, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ReshardError, match="is a file, not a checkpoint folder"):
        load_manifest(tmp_path / "file")
    with pytest.raises(ReshardError, match="does not exist"):
        load_manifest(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReshardError, match="is not a checkpoint: manifest.json is missing"):
        load_manifest(tmp_path / "empty")
    for name, data, message in [
        ("latin1", b"\xff\xfe{}", "is not UTF-8 text (byte 0)"),
        ("truncated", b'{"format": "ms-reshard-checkpoint", "vers', "is not valid JSON"),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_bytes(data)
        with pytest.raises(ReshardError, match=re.escape(message)):
            load_manifest(tmp_path / name)


# ------------------------------------------------------------------------------- fuzzed readers
def _trees(ints, leaves=None):
    scalars = st.none() | st.booleans() | ints | st.floats(allow_nan=False) | st.text(max_size=8)
    scalars = scalars if leaves is None else scalars | leaves
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
        max_leaves=12,
    )


JSON = _trees(st.integers(-(2**70), 2**70))


def _paths(node, prefix=()):
    """Every (key, key, ...) path into a JSON-like tree, the root included."""
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from _paths(v, (*prefix, k))


def _replace(tree, path, value):
    if not path:
        return value
    node = tree
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return tree


@pytest.fixture(scope="module")
def fuzz_dir(good, tmp_path_factory) -> Path:
    ck = tmp_path_factory.mktemp("fuzz") / "ck"
    shutil.copytree(good, ck)
    return ck


@FUZZ
@given(data=st.data())
def test_fuzzed_manifest_gives_only_reshard_error(good, fuzz_dir, data):
    manifest = json.loads((good / "manifest.json").read_text())
    path = data.draw(st.sampled_from(list(_paths(manifest))))
    edited = _replace(json.loads(json.dumps(manifest)), path, data.draw(JSON))
    (fuzz_dir / "manifest.json").write_text(json.dumps(edited))
    try:
        verify(fuzz_dir, load_manifest(fuzz_dir))
        load_checkpoint(fuzz_dir)
    except ReshardError:
        pass


@FUZZ
@given(blob=st.binary(max_size=512))
def test_manifest_bytes_give_only_reshard_error(fuzz_dir, blob):
    (fuzz_dir / "manifest.json").write_bytes(blob)
    with pytest.raises(ReshardError):
        load_manifest(fuzz_dir)


def _tiny_plan():
    from ms_reshard.layout_text import parse_layout

    return plan(parse_layout("dp=2,tp=2:tp,None"), parse_layout("tp=4:None,tp@2-5"), (8, 8))


LEAF = _trees(st.integers(-(2**70), 2**70), st.binary(max_size=24))
MSGPACK_LEAF = _trees(st.integers(-(2**63), 2**64 - 1), st.binary(max_size=24))  # what msgpack can pack


@FUZZ
@given(data=st.data())
def test_fuzzed_plan_gives_only_reshard_error(data):
    d = plan_to_dict(_tiny_plan())
    path = data.draw(st.sampled_from(list(_paths(d))))
    edited = _replace(d, path, data.draw(LEAF))
    try:
        p = plan_from_dict(edited)
    except ReshardError:
        return
    try:  # what loads must also validate and print without another error
        validate(p)
        format_plan(p)
    except ReshardError:
        pass


@FUZZ
@given(data=st.data())
def test_fuzzed_plan_bytes_give_only_reshard_error(data):
    blob = bytearray(plan_to_bytes(_tiny_plan()))
    kind = data.draw(st.sampled_from(["flip", "truncate", "random", "repacked"]))
    if kind == "flip":
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif kind == "random":
        blob = bytearray(data.draw(st.binary(max_size=256)))
    else:
        envelope = msgpack.unpackb(bytes(blob))
        path = data.draw(st.sampled_from(list(_paths(envelope["data"]))))
        envelope["data"] = _replace(envelope["data"], path, data.draw(MSGPACK_LEAF))
        blob = bytearray(msgpack.packb(envelope, use_bin_type=True))
    try:
        plan_from_bytes(bytes(blob))
    except ReshardError:
        pass


@FUZZ
@given(data=st.data())
def test_fuzzed_model_plan_gives_only_reshard_error(data):
    shapes = {"model.embed_tokens.weight": (8, 4), "model.norm.weight": (4,)}
    src = param_specs(shapes, ParallelConfig(tp=2), num_layers=1)
    dst = param_specs(shapes, ParallelConfig(dp=2), num_layers=1)
    d = model_plan_to_dict(model_plan(src, dst))
    path = data.draw(st.sampled_from(list(_paths(d))))
    try:
        model_plan_from_dict(_replace(d, path, data.draw(LEAF)))
    except ReshardError:
        pass


def test_plan_fields_are_named():
    d = plan_to_dict(_tiny_plan())
    cases = [
        ({**d, "version": True}, "reshard plan version True; this reader knows 1..2"),
        ({**d, "shape": [8, -8]}, "plan field shape = [8, -8] must be a list of non-negative ints"),
        ({**d, "itemsize": 4.0}, "plan field itemsize = 4.0; expected an int >= 1"),
        ({**d, "ranks": {"shape": [2], "data": b"\0" * 8}}, "plan field ranks: shape [2] needs 16 bytes, its data has"),
        ({**d, "xfer": {**d["xfer"], "src": {"shape": [1], "data": (99).to_bytes(8, "little")}}}, "holds ids outside"),
        ({**d, "collectives": "none"}, "plan field collectives = 'none'; expected a list"),
        ({**d, "rounds": 0}, "plan field rounds = 0; expected an int >= 1"),
        ([d], "not a reshard plan: a list, expected a map"),
    ]
    for bad, message in cases:
        with pytest.raises(ReshardError, match=re.escape(message)):
            plan_from_dict(bad)
    assert plan_from_dict(d).bytes_moved() == _tiny_plan().bytes_moved()


# ----------------------------------------------------------------------------------- the CLI
def _cli(args, env=None):
    env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "ms_reshard.cli", *args], capture_output=True, text=True, env=env)


def _cli_error(args, env=None) -> str:
    """The one stderr line of a run that must fail with exit code 2."""
    proc = _cli(args, env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ms-reshard: error: "), proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def inputs(good, tmp_path_factory) -> dict[str, str]:
    """Named bad inputs on disk, next to a good checkpoint."""
    root = tmp_path_factory.mktemp("cli")
    files = {
        "FILE": b"not a folder",
        "LATIN1_JSON": b'{"dp": "\xff"}',
        "LIST_JSON": b"[1, 2]",
        "GARBAGE": b"\x93\x01\x02",
        "FUSION_MAP": b'{"fused": "qkv_proj"}',
        "FUSION_PARTS_TEXT": b'[{"fused": "qkv_proj", "parts": "qkv"}]',
    }
    out = {name: str(root / name) for name in files}
    for name, data in files.items():
        (root / name).write_bytes(data)
    for name, data in [("LATIN1_CK", b"\xff\xfe"), ("TRUNCATED_CK", b'{"format": ')]:
        (root / name).mkdir()
        (root / name / "manifest.json").write_bytes(data)
        out[name] = str(root / name)
    escape = root / "escape"
    escape.mkdir()
    out["ESCAPE_CK"] = str(_edited(good, escape, _path_to(lambda o, r: "../outside.safetensors")))
    huge = root / "huge"
    huge.mkdir()
    out["HUGE_CK"] = str(_edited(good, huge, _set(f"params/{P}/shape", [1 << 40, 1 << 20])))
    (root / "EXISTS").mkdir()
    out.update(GOOD=str(good), MISSING=str(root / "missing"), DST=str(root / "dst"), EXISTS=str(root / "EXISTS"))
    return out


def _ck(src="GOOD", dst="DST", *rest):
    return ["checkpoint", src, dst, "--dst-config", "tp=1", *rest]


def _plan(*rest, src="tp=2:tp,None", dst="tp=4:None,tp", shape="8,8"):
    return ["plan", "--src", src, "--dst", dst, "--shape", shape, *rest]


CLI_CASES = [
    ("ck-on-a-file", _ck("FILE"), "FILE' is a file, not a checkpoint folder"),
    ("ck-missing", _ck("MISSING"), "missing' does not exist"),
    ("ck-not-utf8", _ck("LATIN1_CK"), "is not UTF-8 text (byte 0)"),
    ("ck-truncated-json", _ck("TRUNCATED_CK"), "is not valid JSON: Expecting value"),
    ("ck-path-escape", _ck("ESCAPE_CK"), "'../outside.safetensors' leaves its folder"),
    ("ck-shape-1EiB", _ck("HUGE_CK"), "is over the limit of 1099511627776 bytes of one tensor"),
    ("ck-dst-is-a-file", _ck("GOOD", "FILE", "--overwrite"), "FILE' is a file, not a checkpoint folder"),
    ("ck-dst-exists", _ck("GOOD", "EXISTS"), "EXISTS already exists; pass overwrite=True (--overwrite)"),
    ("config-entry", ["checkpoint", "GOOD", "DST", "--dst-config", "tp=x"], "config entry 'tp=x' in 'tp=x'"),
    ("config-superscript", ["checkpoint", "GOOD", "DST", "--dst-config", "tp=²"], "config entry 'tp=²'"),
    ("config-1e9-ranks", ["checkpoint", "GOOD", "DST", "--dst-config", "dp=1000000000"], "= 1000000000 is over"),
    ("config-order", ["checkpoint", "GOOD", "DST", "--dst-config", "order=tp"], "order 'tp' must name each of"),
    ("config-not-utf8", ["checkpoint", "GOOD", "DST", "--dst-config", "LATIN1_JSON"], "not a ParallelConfig"),
    ("config-garbage", ["checkpoint", "GOOD", "DST", "--dst-config", "GARBAGE"], "not a ParallelConfig"),
    ("src-config-wrong", _ck("GOOD", "DST", "--src-config", "tp=1"), "tp=1:tp,None@0, but the checkpoint holds dp=1"),
    ("num-layers-0", _ck("GOOD", "DST", "--num-layers", "0"), "--num-layers 0: expected a positive number"),
    ("num-layers-1e9", _ck("GOOD", "DST", "--num-layers", "1000000000"), "MS_RESHARD_MAX_LAYERS=N"),
    ("num-experts-negative", _ck("GOOD", "DST", "--num-experts", "-4"), "--num-experts -4: expected a positive"),
    ("fusion-missing", _ck("GOOD", "DST", "--fusion", "MISSING"), "missing' does not exist"),
    ("fusion-not-a-list", _ck("GOOD", "DST", "--fusion", "FUSION_MAP"), "fusion rules must be a list of rule objects"),
    ("fusion-parts-text", _ck("GOOD", "DST", "--fusion", "FUSION_PARTS_TEXT"), "needs 'fused' (a name) and 'parts'"),
    ("fusion-not-utf8", _ck("GOOD", "DST", "--fusion", "LATIN1_JSON"), "is not UTF-8 text"),
    ("dst-dtype", _ck("GOOD", "DST", "--dst-dtype", "complex64"), "--dst-dtype 'complex64': a checkpoint holds"),
    ("dst-dtype-bf16", _ck("GOOD", "DST", "--dst-dtype", "bfloat16"), "--dst-dtype 'bfloat16': a checkpoint holds"),
    ("layout-no-map", _plan(src="dp=2"), "layout 'dp=2' must look like MESH:MAP[@RANKS]"),
    ("layout-1e9-ranks", _plan(src="tp=1000000000:tp,None"), "= 1000000000 is over the limit of 65536 ranks"),
    ("layout-rank-range", _plan(src="tp=2:tp,None@0-99999999999"), "rank 99999999999 in '0-99999999999' = "),
    ("layout-rank-text", _plan(src="tp=2:tp,None@a-b"), "rank list 'a-b' must be ints and ranges"),
    ("layout-superscript", _plan(src="tp=²:tp,None"), "mesh entry 'tp=²' in 'tp=²:tp,None' must look like"),
    ("layout-alias", _plan(src="tp=2:xx,None"), "unknown alias 'xx'"),
    ("layout-file-garbage", _plan(src="GARBAGE"), "GARBAGE: not an ms-layout blob"),
    ("layout-file-not-utf8", _plan(src="LATIN1_JSON"), "LATIN1_JSON: not an ms-layout blob"),
    ("shape-negative", _plan(shape="8,-8"), "--shape '8,-8': expected comma-separated non-negative ints"),
    ("shape-text", _plan(shape="8,a"), "--shape '8,a': expected comma-separated non-negative ints"),
    ("shape-huge", _plan(shape="99999999999,99999999999"), "MS_RESHARD_MAX_TENSOR_BYTES=N"),
    ("shape-ndim", _plan(shape="8"), "cannot hold global shape (8,)"),
    ("dtype", _plan("--dtype", "nope"), "unknown dtype 'nope'"),
    ("mem-cap", _plan("--mem-cap", "0"), "mem_cap=0 must be None or an int of at least one element"),
]


@pytest.mark.parametrize("argv, message", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_is_one_line_and_exit_2(inputs, argv, message):
    args = [inputs.get(a, a) for a in argv]
    line = _cli_error(args)
    assert message in line, line
    assert not Path(inputs["DST"]).exists()


def test_cli_debug_shows_the_traceback(inputs):
    proc = _cli(["--debug", *[inputs.get(a, a) for a in _ck("FILE")]])
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "ReshardError" in proc.stderr


@pytest.mark.parametrize(
    "env, message",
    [
        ({}, "is over the limit of 1099511627776 bytes of one tensor (raise it with MS_RESHARD_MAX_TENSOR_BYTES=N)"),
        # with the limit raised, the files' sizes still refuse the claim before anything is allocated
        ({"MS_RESHARD_MAX_TENSOR_BYTES": str(1 << 70)}, "but the shards it lists need 2305843009213700800 bytes"),
    ],
    ids=["limit", "file-size"],
)
def test_huge_shape_is_refused_before_allocating(inputs, env, message):
    """The manifest claims lm_head is [2^40, 2^20] float32 (4 EiB); the run stays under 400 MB."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ms_reshard.cli", *[inputs.get(a, a) for a in _ck("HUGE_CK")]],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env={**os.environ, **env},
    )
    stderr = proc.stderr.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 2 and message in stderr and len(stderr.splitlines()) == 1, stderr
    assert usage.ru_maxrss < 400 * 1024, f"peak RSS {usage.ru_maxrss} KiB"
