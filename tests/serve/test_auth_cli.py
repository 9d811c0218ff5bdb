"""Tokens, binding, the page's cookie login with CSRF, the Modal dispatcher up to the SDK, and the
hostile inputs of the API: no training run, only the app in process (Starlette's TestClient)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import yaml
from fastapi.testclient import TestClient

from scaletune.serve.app import create_app
from scaletune.serve.edge.auth import COOKIE, bind_problems, create_token
from scaletune.serve.jobs.db import Token
from scaletune.serve.jobs.service import JobService
from tests.helpers import REPO_ROOT, make_config
from tests.serve.serve_helpers import TEST_POLICY, plant_job

LOOPBACK = "http://127.0.0.1"  # a tokenless service answers loopback names only (DNS rebinding)


@pytest.fixture
def svc(tmp_path):
    s = JobService(
        f"sqlite:///{tmp_path / 'db.sqlite'}",
        tmp_path / "jobs",
        "http://127.0.0.1:9",
        policy=TEST_POLICY,
        public_url="https://jobs.example.com",  # Modal jobs are refused without one
    )
    yield s
    s.engine.dispose()


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)])}
    return subprocess.run(
        [sys.executable, "-m", "scaletune", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_token_create_prints_it_last_and_stores_its_hash(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    r = cli("serve", "token", "create", "--scope", "submit", "--db", url)
    assert r.returncode == 0, r.stderr
    token = r.stdout.split()[-1]
    s = JobService(url, tmp_path / "jobs", "http://x")
    with s.Session() as db:
        rows = db.query(Token).all()
    assert [t.scope for t in rows] == ["submit"] and rows[0].hash != token and len(rows[0].hash) == 64
    assert token.encode() not in (tmp_path / "db.sqlite").read_bytes()
    r = cli("serve", "token", "create", "--scope", "root", "--db", url)
    assert r.returncode == 2 and "--scope 'root'" in r.stderr and "Traceback" not in r.stderr


def test_refuses_public_bind_without_tokens(svc, tmp_path):
    assert bind_problems("127.0.0.1", svc.Session) == [] and bind_problems("::1", svc.Session) == []
    assert "without API tokens" in bind_problems("0.0.0.0", svc.Session)[0].text()
    r = cli("serve", "--host", "0.0.0.0", "--db", f"sqlite:///{tmp_path / 'db.sqlite'}", "--jobs-dir", str(tmp_path))
    assert r.returncode == 2 and "loopback" in r.stderr and "Traceback" not in r.stderr
    create_token(svc.Session, "admin")
    assert bind_problems("0.0.0.0", svc.Session) == []


def test_cookie_login_needs_csrf_for_changes(svc, tiny_model_dir, tmp_path):
    token = create_token(svc.Session, "submit")
    body = {"config": yaml.safe_dump(make_config(tiny_model_dir, tmp_path / "run")), "dry_run": True}
    with TestClient(create_app(svc, start=False), base_url=LOOPBACK) as c:
        assert c.get("/", follow_redirects=False).headers["location"] == "/login"
        assert (
            c.post("/login", data={"token": "st_nope"}, follow_redirects=False)
            .headers["location"]
            .startswith("/login?error")
        )
        r = c.post("/login", data={"token": token}, follow_redirects=False)
        cookie = r.headers["set-cookie"]
        assert COOKIE in cookie and "HttpOnly" in cookie and "samesite=strict" in cookie.lower()
        page = c.get("/").text
        csrf = page.split('name="csrf" content="')[1].split('"')[0]
        assert len(csrf) == 64 and token not in page
        assert c.get("/api/jobs").status_code == 200  # reading by cookie needs no CSRF token
        assert c.post("/api/jobs", json=body).status_code == 403  # a cross-site form could do this
        assert c.post("/api/jobs", json=body, headers={"X-CSRF-Token": "0" * 64}).status_code == 403
        assert c.post("/api/jobs", json=body, headers={"X-CSRF-Token": csrf}).status_code == 200


def test_unknown_target_and_resources_are_422(svc, tiny_model_dir, tmp_path):
    cfg = yaml.safe_dump(make_config(tiny_model_dir, tmp_path / "run"))
    with TestClient(create_app(svc, start=False), base_url=LOOPBACK) as c:
        r = c.post("/api/jobs", json={"config": cfg, "target": "k8s"})
        assert r.status_code == 422 and "target 'k8s'" in r.json()["problems"][0]
        r = c.post("/api/jobs", json={"config": cfg, "target": "slurm", "resources": {"gpus": 1}, "dry_run": True})
        assert r.status_code == 422 and "resources.gpus" in r.json()["problems"][0]
        assert c.get("/api/jobs/nope").status_code == 404
        assert c.get("/api/jobs").json() == []


def test_missing_job_is_404_and_a_real_key_error_is_not(svc, monkeypatch):
    """`JobNotFound` means no such job (404); a KeyError from a bug is a server error, not a 404."""
    with TestClient(create_app(svc, start=False), base_url=LOOPBACK, raise_server_exceptions=False) as c:
        for verb in ("stop", "cancel", "resume", "clone"):
            r = c.post(f"/api/jobs/nope/{verb}", json={})
            assert (r.status_code, r.json()["detail"]) == (404, "no job nope"), (verb, r.text)
        with pytest.raises(LookupError):
            svc.stop("nope")

        def bug(job_id):
            raise KeyError("a missing dict key")

        monkeypatch.setattr(svc, "stop", bug)
        job_id = plant_job(svc, svc.home / "planted-run", state="running")  # found: the bug runs
        assert c.post(f"/api/jobs/{job_id}/stop").status_code == 500


def test_modal_up_to_the_sdk(svc, tiny_model_dir, tmp_path, monkeypatch):
    """No Modal account is reachable here: the app is generated and handed to the SDK, and Modal's
    refusal (no credentials) ends the job `failed` with reason `submit failed`."""
    for k in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "no-modal.toml"))
    # ddp: the dry run's 2 GPUs are 2 ranks (single would be refused, as `scaletune modal --gpu-count 2` refuses it).
    cfg = yaml.safe_dump(make_config(tiny_model_dir, tmp_path / "run", distributed={"strategy": "ddp"}))
    with TestClient(create_app(svc, start=False), base_url=LOOPBACK) as c:
        r = c.post("/api/jobs", json={"config": cfg, "target": "modal", "dry_run": True, "resources": {"gpu_count": 2}})
        app = r.json()["plan"]["modal_app"]
        compile(app, "modal_app.py", "exec")
        assert "import modal" in app and "GPU_COUNT = 2" in app and "--nproc-per-node" in app
        r = c.post("/api/jobs", json={"config": cfg, "target": "modal"})
        assert r.status_code == 201
        deadline = time.monotonic() + 30
        while (job := c.get(f"/api/jobs/{r.json()['id']}").json())["state"] == "starting":  # a worker deploys
            assert time.monotonic() < deadline, job
            time.sleep(0.1)
    assert job["state"] == "failed" and job["reason"] == "submit failed", job
    assert "Modal refused the job" in job["message"] and "token" in job["message"].lower()
