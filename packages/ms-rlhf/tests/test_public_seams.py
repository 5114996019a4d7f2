"""ms-rlhf reaches its sibling packages only through their public ``__init__`` names (DESIGN.md):
a private module of ms-reshard or ms-vllm may move without notice."""

from __future__ import annotations

import re
from pathlib import Path

import ms_rlhf

SIBLINGS = ("ms_layout", "ms_models", "ms_reshard", "ms_vllm")
# `from ms_reshard.execute import x` or `import ms_reshard.execute`. Allowed: `ms_layout.comm` (in
# ms-layout's __all__) and `ms_layout.serialization`, whose `register` is the documented hook for
# other packages' msgpack kinds, and the modules every package shares for files, limits and console
# errors (issue 16: ms_layout.files, ms_layout.limits, ms_layout.console), and ms_models.parallel, the
# public subpackage of tensor-parallel layers that the trainer's TP actor is built from.
ALLOWED = {("ms_layout", "serialization"), ("ms_layout", "files"), ("ms_layout", "limits"), ("ms_layout", "console")}
ALLOWED.add(("ms_models", "parallel"))
PRIVATE = re.compile(rf"^\s*(?:from|import)\s+({'|'.join(SIBLINGS)})\.(\w+)", re.M)


def test_no_private_sibling_imports():
    import ms_layout

    found = []
    for path in Path(ms_rlhf.__file__).parent.rglob("*.py"):
        for match in PRIVATE.finditer(path.read_text()):
            package, module = match.groups()
            if (package, module) in ALLOWED or (package == "ms_layout" and module in ms_layout.__all__):
                continue
            found.append(f"{path.name}: {match.group(0).strip()}")
    assert found == []
