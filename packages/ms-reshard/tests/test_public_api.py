"""The online executor is a public name of the package, and naming it is what loads MindSpore."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_importing_the_core_does_not_load_mindspore():
    code = "import sys, ms_reshard; sys.exit('mindspore' in sys.modules or 'safetensors' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_checkpoint_functions_are_exported():
    import ms_reshard
    from ms_reshard import checkpoint

    for name in ("save_checkpoint", "load_checkpoint", "load_manifest", "reshard_checkpoint"):
        assert getattr(ms_reshard, name) is getattr(checkpoint, name)
        assert name in ms_reshard.__all__


@pytest.mark.needs_mindspore
def test_reshard_parameters_is_exported():
    pytest.importorskip("mindspore")
    import ms_reshard
    from ms_reshard.execute import reshard_parameters

    assert ms_reshard.reshard_parameters is reshard_parameters
    assert "reshard_parameters" in ms_reshard.__all__
    with pytest.raises(AttributeError, match="no_such_name"):
        ms_reshard.no_such_name  # noqa: B018
