"""msrun's multi-node launch on one host: two network namespaces of a shaped network act as two
nodes (``--node_rank``, ``--master_addr`` = node 0's address), one worker each. ms_layout.comm's
collectives (gloo and MindSpore's own backend) and a ZeroBubbleV pipeline step of the tiny
DeepSeek-V3 run across them; the traffic is checked to have crossed the shaped links (tc's
counters), and the pipelined step equals the single-process step."""

from __future__ import annotations

import json

import _tiny
import numpy as np
import pytest
from conftest import SCRIPTS, logs, run_msrun_nodes

from ms_layout.testing import assert_close

pytestmark = [pytest.mark.needs_mindspore, pytest.mark.timeout(600)]


def _results(out, suffix=".json"):
    return sorted((json.loads(p.read_text()) for p in out.glob(f"rank*{suffix}")), key=lambda r: r["rank"])


@pytest.mark.parametrize("backend", ["gloo", "mindspore"])
def test_collectives_across_two_namespace_nodes(tmp_path, shaped_network, backend):
    net = shaped_network(2, rate="200mbit")
    out = tmp_path / "out"
    out.mkdir()
    sent = [net.sent_bytes(node) for node in range(2)]
    rcs = run_msrun_nodes(net, SCRIPTS / "msrun_collectives.py", [backend, str(out)], tmp_path / "log", timeout=240)
    assert rcs == [0, 0], logs(tmp_path / "log" / "node0") + logs(tmp_path / "log" / "node1")
    results = _results(out)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["size"] == 2 and r["launcher"] == "msrun"
        np.testing.assert_array_equal(r["sum"], [3.0] * 4)
        np.testing.assert_array_equal(r["gathered"], [0.0, 10.0])
    # both nodes talked over their own shaped link (the scheduler's handshakes at least)
    assert all(net.sent_bytes(node) > sent[node] for node in range(2))


def test_zero_bubble_v_across_two_namespace_nodes_matches_single_process(tmp_path, shaped_network):
    net = shaped_network(2, rate="200mbit")
    out = tmp_path / "out"
    out.mkdir()
    sent = [net.sent_bytes(node) for node in range(2)]
    rcs = run_msrun_nodes(net, SCRIPTS / "msrun_pipeline.py", [str(out)], tmp_path / "log", timeout=400)
    assert rcs == [0, 0], logs(tmp_path / "log" / "node0") + logs(tmp_path / "log" / "node1")
    results = _results(out)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["stages"] for r in results] == [[0, 3], [1, 2]]  # the V over the two nodes
    assert results[0]["netns"] != results[1]["netns"]  # each rank in its own node's namespace
    assert {r["sched_host"] for r in results} == {net.address(0)}
    # every microbatch's activation and gradient crossed the links: M x 2 boundaries x 2 directions
    activation = _tiny.MB * _tiny.SEQ * _tiny.config().hidden_size * 4
    assert all(net.sent_bytes(node) - sent[node] > 2 * _tiny.M * activation for node in range(2))

    ref_net = _tiny.model()
    loss, reference = _tiny.reference_step(ref_net, *_tiny.data(ref_net.config.vocab_size))
    seen = set()
    for r in results:
        assert_close(r["loss"], loss, _tiny.RTOL, f"rank {r['rank']} loss")
        with np.load(out / f"rank{r['rank']}.npz") as grads:
            for name in grads.files:
                assert_close(grads[name], reference[name], _tiny.RTOL, f"rank {r['rank']} grad {name}")
                seen.add(name)
    assert seen == set(reference)
