"""A slow target does not freeze the service: while the real SLURM dispatcher's `sbatch` (then its
`squeue`) takes 3 s, another job's reported metrics are stored and served within 1 s, and the
request that submitted the SLURM job does not wait for sbatch.

The slow executables are stand-ins on PATH (shell scripts named sbatch, squeue and scancel that
sleep, then answer as SLURM does); the real SLURM cluster of tests/system is not started for this
timing test. The control: the stand-in's own 3 s (the job's target id appears only after it)."""

from __future__ import annotations

import time

import httpx
import yaml

from scaletune.serve.edge.auth import create_token
from tests.helpers import make_config
from tests.serve.serve_helpers import Server, client, plant_job

SLOW_S = 3.0


def stand_ins(folder, marks):
    folder.mkdir()
    scripts = {
        "sbatch": f'touch "{marks}/sbatch-started"\nsleep {SLOW_S}\necho 4242\n',
        "squeue": f'touch "{marks}/squeue-started"\nsleep {SLOW_S}\necho PENDING\n',
        "scancel": "exit 0\n",
    }
    for name, body in scripts.items():
        p = folder / name
        p.write_text("#!/bin/sh\n" + body)
        p.chmod(0o755)


def wait_for(path, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def metric_latency(c: httpx.Client, job_id: str, token: str, step: int) -> float:
    """Seconds from posting a metric line for `job_id` with its report token to reading it back."""
    t0 = time.monotonic()
    r = httpx.post(
        f"{c.base_url}/api/jobs/{job_id}/report",
        json={"events": [{"kind": "metric", "data": {"step": step, "loss": 1.0}}]},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert r.json() == {"accepted": 1}, r.text
    while not any(m["step"] == step for m in c.get(f"/api/jobs/{job_id}/metrics").json()):
        assert time.monotonic() - t0 < 10, "the metric never appeared"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_slow_sbatch_and_squeue_do_not_hold_other_jobs(tmp_path, tiny_model_dir, monkeypatch):
    marks = tmp_path / "marks"
    marks.mkdir()
    stand_ins(tmp_path / "bin", marks)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{__import__('os').environ['PATH']}")
    srv = Server(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs")
    try:
        c = client(srv, create_token(srv.svc.Session, "admin"))
        other = plant_job(srv.svc, tmp_path / "other-run", state="running", token="stj_other")
        body = {
            "config": yaml.safe_dump(make_config(tiny_model_dir, tmp_path / "run")),
            "target": "slurm",
            "resources": {"gpus_per_node": 0, "procs_per_node": 1},
        }
        r = c.post("/api/jobs", json=body)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        wait_for(marks / "sbatch-started")
        submitted = time.monotonic()
        assert metric_latency(c, other, "stj_other", 1) < 1.0  # while sbatch sleeps
        assert c.get(f"/api/jobs/{job_id}").json()["target_id"] is None  # sbatch has not answered yet
        deadline = time.monotonic() + 20
        while (job := c.get(f"/api/jobs/{job_id}").json())["target_id"] is None:
            assert time.monotonic() < deadline, job
            time.sleep(0.05)
        assert time.monotonic() - submitted >= SLOW_S - 0.5  # the control: sbatch's own time
        assert (job["target_id"], job["state"]) == ("4242", "queued"), job
        wait_for(marks / "squeue-started")
        assert metric_latency(c, other, "stj_other", 2) < 1.0  # while squeue sleeps
        assert c.get(f"/api/jobs/{job_id}").json()["state"] == "queued"
    finally:
        srv.stop()
