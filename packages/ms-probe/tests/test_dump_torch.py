"""The PyTorch dumper: same layout and names as MindSpore's, with `Module.` items."""

import json
import os

import numpy as np
import pytest

from ms_probe import PrecisionDebugger

pytestmark = pytest.mark.needs_torch


def _net():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_modules_gradients_and_api_level(tmp_path):
    import torch

    net = _net()
    x = torch.randn(3, 4)
    dbg = PrecisionDebugger(dump_path=str(tmp_path), task="tensor", level="mix")
    dbg.start(net)
    net(x).sum().backward()
    folder = dbg.stop()
    dbg.step()
    data = json.load(open(os.path.join(folder, "dump.json")))["data"]
    assert "Module.0.Linear.forward.0" in data and "Module.2.Linear.backward.0" in data
    info = data["Module.0.Linear.forward.0"]["output"][0]
    assert (info["type"], info["dtype"], info["requires_grad"]) == ("torch.Tensor", "torch.float32", True)
    grad = np.load(
        os.path.join(folder, "dump_tensor_data", data["Module.2.Linear.parameters_grad.0"]["weight"][0]["data_name"])
    )
    np.testing.assert_allclose(grad, net[2].weight.grad.numpy(), rtol=1e-6)
    construct = json.load(open(os.path.join(folder, "construct.json")))
    assert construct["Functional.linear.0.forward"] == "Module.0.Linear.forward.0"
    assert "Functional.relu.0.forward" in data
    # Steps that are not dumped run without hooks.
    assert not net[0]._forward_hooks and not net[0]._backward_hooks
    dbg.close()


def test_list_of_models_and_data_mode(tmp_path):
    import torch

    a, b = _net(), _net()
    dbg = PrecisionDebugger(dump_path=str(tmp_path), data_mode=["forward"])
    dbg.set_init_step(5)  # a resumed run numbers its steps on
    with dbg.dump_step([a, b]):
        a(torch.randn(2, 4))
        b(torch.randn(2, 4))
    assert dbg.current_step == 6
    data = json.load(open(os.path.join(tmp_path, "step5", "rank0", "dump.json")))["data"]
    assert "Module.1.0.Linear.forward.0" in data and not any(".backward." in k for k in data)


def test_one_folder_per_rank_from_the_launcher_environment(tmp_path, monkeypatch):
    import torch

    from ms_probe import compare_dirs

    for side, bad_rank in (("t", 1), ("g", None)):
        for rank in (0, 1, 2):
            monkeypatch.setenv("RANK_ID", str(rank))  # what msrun sets for each worker
            net = _net()
            if rank == bad_rank:
                with torch.no_grad():
                    net[2].weight.mul_(1.5)  # the bug: a scaled weight on one rank
            dbg = PrecisionDebugger(dump_path=str(tmp_path / side), rank=[0, 1])
            with dbg.dump_step(net):
                net(torch.ones(2, 4)).sum().backward()
            dbg.close()
    assert sorted(os.listdir(tmp_path / "t" / "step0")) == ["rank0", "rank1"]  # rank 2 is filtered out
    run = compare_dirs(str(tmp_path / "t"), str(tmp_path / "g"))
    assert [r.rank for r in run.ranks] == [0, 1]
    assert [r.first_divergence for r in run.ranks] == [None, "Module.2.Linear.forward.0"]
    assert run.summary()["first_divergence_rank"] == 1
