"""The shipped MindSpore Transformers <-> Megatron mappings checked against the frameworks
themselves, not against a name list: the Megatron side against the module tree of a real
megatron-core GPTModel built on CPU (tests/megatron_tree.py; Llama-style and DeepSeek-V3-style
configs), the MindSpore Transformers side against the attribute names its training-graph source
assigns (`self.<name> = ...` in `mindformers/parallel_core/training_graph` and the model classes
built on it, read with `ast`, never imported: it needs Ascend-era dependencies). The second is a
check of names, not of where they sit in the tree."""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ms_probe import load_mapping

pytestmark = [pytest.mark.needs_torch, pytest.mark.timeout(300)]

MAPPINGS = {"llama": "mindformers-megatron-llama", "deepseek_v3": "mindformers-megatron-deepseek-v3"}
CONTAINERS = {"ModuleList"}  # hold modules, never called: no dump item


@functools.cache
def megatron_tree(kind: str) -> dict[str, str]:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed (nox installs it: ms-probe's nox-preinstall)")
    script = Path(__file__).with_name("megatron_tree.py")
    done = subprocess.run([sys.executable, str(script), kind], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@functools.cache
def mindformers_attributes() -> frozenset[str]:
    spec = importlib.util.find_spec("mindformers")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("mindformers (MindSpore Transformers) is not installed (nox installs it without dependencies)")
    root = Path(next(iter(spec.submodule_search_locations)))
    # the training graph's Cells, and the model classes that build them (self.model = GPTModel(...))
    sources = [p.read_text(encoding="utf-8") for p in (root / "parallel_core" / "training_graph").rglob("*.py")]
    models = (p.read_text(encoding="utf-8") for p in (root / "models").rglob("*.py"))
    sources += [text for text in models if "parallel_core.training_graph" in text]
    assert len(sources) > 20, f"{root}: no MindSpore Transformers training_graph source found"
    names = set()
    for text in sources:
        for node in ast.walk(ast.parse(text)):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return frozenset(names)


def _literal_segments(template: str) -> list[str]:
    return [s for s in template.split(".") if s and "{" not in s and not s.isdigit()]


@pytest.mark.parametrize("kind", sorted(MAPPINGS))
def test_golden_names_are_real_megatron_modules(kind):
    """Every Megatron path a mapping names (renames and skips) is a module of the real tree."""
    tree = megatron_tree(kind)
    mapping = load_mapping(MAPPINGS[kind])
    templates = [r.golden for r in mapping.rules] + [s.path for s in mapping.skips if s.side == "golden"]
    templates += [part for j in mapping.joins if j.side == "golden" for part in j.parts]  # MLA's two down projections
    stale = [t.text for t in templates if not any(t.match(path) is not None for path in tree)]
    assert not stale, f"{MAPPINGS[kind]}: no module of megatron-core's {kind} GPTModel matches {stale}"
    # the interleaved-fc1 rule's module exists on the Megatron side (test_data_layouts checks the rule)
    fc1 = [r.path for r in mapping.layouts if r.path.text.endswith(".mlp.linear_fc1")]
    assert fc1 and mapping.map_path(fc1[0].fill({"i": "0"})) in tree


@pytest.mark.parametrize("kind", sorted(MAPPINGS))
def test_every_megatron_module_has_a_mindformers_counterpart_or_a_skip(kind):
    """Each module of the real Megatron tree is either skipped with a reason or maps to a
    MindSpore Transformers path every name of which its source assigns."""
    tree, attributes = megatron_tree(kind), mindformers_attributes()
    mapping = load_mapping(MAPPINGS[kind])
    reverse = mapping.reversed()
    missing = {}
    for path, cls in tree.items():
        if not path or cls in CONTAINERS or mapping.skip_reason("golden", path):
            continue
        target = reverse.map_path(path)
        unknown = [s for s in _literal_segments(target) if s not in attributes]
        if unknown:
            missing[path] = (target, unknown)
    assert not missing, f"{MAPPINGS[kind]}: Megatron modules whose counterpart MindFormers does not have: {missing}"


@pytest.mark.parametrize("kind", sorted(MAPPINGS))
def test_target_names_are_mindformers_attributes(kind):
    """Every MindSpore Transformers path a mapping names is made of names its source assigns."""
    attributes = mindformers_attributes()
    mapping = load_mapping(MAPPINGS[kind])
    templates = [r.target.text for r in mapping.rules] + [s.path.text for s in mapping.skips if s.side == "target"]
    templates += [r.path.text for r in mapping.layouts]
    # a golden-side join compares its parts with the target's fused module: that one must exist
    templates += [mapping.reversed().map_path(j.path.text) for j in mapping.joins if j.side == "golden"]
    unknown = {t: [s for s in _literal_segments(t) if s not in attributes] for t in templates}
    assert not {t: u for t, u in unknown.items() if u}, unknown
