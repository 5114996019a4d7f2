"""ms_layout.comm under MindSpore's own launcher, msrun: both backends find their rank."""

import json

import numpy as np
import pytest
from conftest import SCRIPTS, logs, run_msrun


@pytest.mark.parametrize("backend", ["gloo", "mindspore"])
def test_collectives_under_msrun(tmp_path, backend):
    out = tmp_path / "out"
    out.mkdir()
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    rc = run_msrun(SCRIPTS / "msrun_collectives.py", [backend, str(out)], workers=2, log_dir=log_dir, timeout=180)
    assert rc == 0, logs(log_dir)
    results = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1], logs(log_dir)
    for r in results:
        assert r["size"] == 2 and r["launcher"] == "msrun"
        np.testing.assert_array_equal(r["sum"], [3.0] * 4)  # 1 + 2 from the two ranks
        np.testing.assert_array_equal(r["gathered"], [0.0, 10.0])
