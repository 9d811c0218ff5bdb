"""`scaletune doctor --comm-test` on two real ranks under torchrun (CPU, gloo): every collective it
measures ran and reported a bandwidth (moved from tests/unit/test_doctor.py, whose tests start no
process)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_torchrun

pytestmark = pytest.mark.distributed


def test_comm_test_under_torchrun(tmp_path):
    proc = run_torchrun("scaletune", "doctor", "--comm-test", "--json", module=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout)
    ops = {(r["op"], r["bytes"]) for r in data["comm_test"]}
    assert {op for op, _ in ops} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert all(r["ok"] and r["busbw_GBps"] > 0 for r in data["comm_test"])
    assert data["report"]["launcher"] == "torchrun" and data["report"]["world_size"] == 2
