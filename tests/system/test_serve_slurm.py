"""`scaletune serve` with target `slurm` on the real one-node SLURM cluster: a job goes
queued -> running -> succeeded, its metrics streamed to the service while it runs."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from scaletune.serve.edge.auth import create_token
from tests.serve.serve_helpers import Server, client, read_events
from tests.system.system_helpers import MAX_STEPS, system_config

pytestmark = [pytest.mark.system]


def test_slurm_job_streams_to_succeeded(slurm_cluster, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", slurm_cluster["SLURM_CONF"])  # the service's squeue/sbatch/scancel
    monkeypatch.setenv("PYTHONPATH", slurm_cluster["PYTHONPATH"])  # sbatch hands it to the job
    srv = Server(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs")
    try:
        c = client(srv, create_token(srv.svc.Session, "submit"))
        cfg = system_config(tiny_model_dir, tmp_path / "run")
        body = {
            "config": yaml.safe_dump(cfg),
            "target": "slurm",
            "resources": {"gpus_per_node": 0, "procs_per_node": 1},
        }
        r = c.post("/api/jobs", json=body)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        events = read_events(
            c, job_id, lambda k, d: k == "state" and d["state"] in ("succeeded", "failed", "cancelled"), timeout=300
        )
        states = [d["state"] for _, k, d in events if k == "state"]
        assert states[-1] == "succeeded", (states, c.get(f"/api/jobs/{job_id}/logs").text[-3000:])
        assert states.index("queued") < states.index("running")
        job = c.get(f"/api/jobs/{job_id}").json()
        assert job["target_id"].isdigit()
        metric_steps = [d["step"] for _, k, d in events if k == "metric"]
        assert metric_steps == list(range(1, MAX_STEPS + 1))
        written = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert c.get(f"/api/jobs/{job_id}/metrics").json() == written
        assert srv.svc.posted.get(job_id, 0) >= MAX_STEPS  # posted from the SLURM job itself
        # The report token reached the job through sbatch's environment, not the script.
        script = (tmp_path / "jobs" / job_id / "job.sbatch").read_text()
        assert "SCALETUNE_REPORT_TOKEN" not in script and srv.svc._tokens[job_id] not in script
        # SLURM's own record, not the service's: the controller ran the job's script to completion
        # under the id the service stored (a job run any other way has no such record).
        shown = subprocess.run(
            ["scontrol", "show", "job", "-o", job["target_id"]],
            capture_output=True,
            text=True,
            env=slurm_cluster,
            timeout=30,
        )
        fields = dict(re.findall(r"(\w+)=(\S*)", shown.stdout))
        assert fields.get("JobId") == job["target_id"], shown.stdout + shown.stderr
        assert fields.get("JobState") == "COMPLETED", shown.stdout
        assert fields.get("Command", "").endswith(f"/{job_id}/job.sbatch"), shown.stdout
    finally:
        srv.cancel_all()
        srv.stop()
