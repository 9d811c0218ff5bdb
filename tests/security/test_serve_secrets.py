"""Secrets through the service (issue 21, item 5): a `distributed.env` secret given in the config
and as an override reaches the job's processes through their environment only: not the API, not
the dry-run command, not serve.db, not the job's config.yaml (0600), not a command line."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import psutil
import yaml
from cryptography.fernet import Fernet

from scaletune.serve.edge.auth import create_token
from scaletune.serve.jobs.dispatch.base import SERVICE_SECRETS
from scaletune.serve.jobs.vault import KEY_ENV
from tests.helpers import make_config
from tests.serve.serve_helpers import TEST_POLICY, Server, client, read_events

IN_CONFIG, IN_OVERRIDE = "hf_in_config_5ec4e7", "wandb_in_override_77a1c0"


# Credentials the service's environment holds besides its own secrets (issue 34, case 2: a job
# inherited them, so a hub or W&B call made for any user went out with the service's identity).
SERVICE_CREDENTIALS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "OPENAI_API_KEY")
# What the operator maps by reference (`scaletune serve --job-secret`): alice's jobs get TEAM_COMET_KEY
# as COMET_API_KEY, every job SHARED_READ_TOKEN as HF_READ_TOKEN, bob's jobs BOB_KEY as BOB_API_KEY.
MAPPED = {"TEAM_COMET_KEY": "comet-for-alice-41d2", "SHARED_READ_TOKEN": "shared-read-8c01", "BOB_KEY": "bob-only-d3"}
JOB_SECRETS = ["alice:COMET_API_KEY=TEAM_COMET_KEY", "*:HF_READ_TOKEN=SHARED_READ_TOKEN", "bob:BOB_API_KEY=BOB_KEY"]


def test_secrets_by_reference_only(tiny_model_dir, tmp_path, monkeypatch):
    # The service's own secrets and credentials, in its environment as a deployment sets them: its
    # jobs inherit its environment without them (a non-secret variable of the service passes: the
    # control), and get only what the operator maps to their owner.
    service_own = {name: f"service-own-{i}-0f3a" for i, name in enumerate(sorted(SERVICE_SECRETS))}
    service_own |= {name: f"service-credential-{i}-77b9" for i, name in enumerate(SERVICE_CREDENTIALS)}
    service_own[KEY_ENV] = Fernet.generate_key().decode()  # the jobs' secrets are sealed with it (not a job's)
    for name, value in {**service_own, **MAPPED, "SCALETUNE_TEST_PASSTHROUGH": "kept"}.items():
        monkeypatch.setenv(name, value)
    srv = Server(
        f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs", policy=TEST_POLICY.updated(job_secrets=JOB_SECRETS)
    )
    submit, read = create_token(srv.svc.Session, "submit", name="alice"), create_token(srv.svc.Session, "read")
    cfg = make_config(tiny_model_dir, tmp_path / "run")
    cfg["training"].update(max_steps=400, save_every=0, micro_batch_size=8)
    cfg["distributed"]["env"] = {"HF_TOKEN": IN_CONFIG, "NCCL_DEBUG": "WARN"}
    body = {"config": yaml.safe_dump(cfg), "overrides": [f"distributed.env.WANDB_API_KEY={IN_OVERRIDE}"]}
    c = client(srv, submit)
    try:
        dry = c.post("/api/jobs", json={**body, "dry_run": True})
        assert dry.status_code == 200, dry.text
        assert IN_CONFIG not in dry.text and IN_OVERRIDE not in dry.text
        r = c.post("/api/jobs", json=body)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        read_events(c, job_id, lambda k, d: k == "metric")
        listing = client(srv, read).get("/api/jobs").text + client(srv, read).get(f"/api/jobs/{job_id}").text
        assert IN_CONFIG not in listing and IN_OVERRIDE not in listing
        # The processes: no secret on a command line, both in the environment of the training rank.
        pid = int(client(srv, read).get(f"/api/jobs/{job_id}").json()["target_id"])
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        for p in tree:
            cmd = " ".join(p.cmdline())
            assert IN_CONFIG not in cmd and IN_OVERRIDE not in cmd, cmd
        envs = [p.environ() for p in tree]
        assert any(e.get("HF_TOKEN") == IN_CONFIG and e.get("WANDB_API_KEY") == IN_OVERRIDE for e in envs)
        assert all(e.get("SCALETUNE_TEST_PASSTHROUGH") == "kept" for e in envs)
        leaked = sorted({k for e in envs for k, v in e.items() if v in service_own.values()})
        assert not leaked, f"the service's own secrets reached its job: {leaked}"
        # Mapped by reference: alice's and everyone's under their job names; bob's and the
        # service's variables under their own names nowhere.
        rank = next(e for e in envs if e.get("HF_TOKEN") == IN_CONFIG)
        assert rank.get("COMET_API_KEY") == MAPPED["TEAM_COMET_KEY"], sorted(rank)
        assert rank.get("HF_READ_TOKEN") == MAPPED["SHARED_READ_TOKEN"], sorted(rank)
        assert not {"BOB_API_KEY", *MAPPED} & {k for e in envs for k in e}
        assert MAPPED["BOB_KEY"] not in {v for e in envs for v in e.values()}
        # Stored files: the job's config without them and private; the database without them.
        job_dir = srv.home / job_id
        assert stat.S_IMODE((job_dir / "config.yaml").stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "db.sqlite").stat().st_mode) == 0o600
        assert "HF_TOKEN" not in (job_dir / "config.yaml").read_text()
        for f in [*job_dir.rglob("*"), *Path(tmp_path).glob("db.sqlite*")]:
            if f.is_file():
                data = f.read_bytes()
                assert IN_CONFIG.encode() not in data and IN_OVERRIDE.encode() not in data, f
    finally:
        srv.cancel_all()
        srv.stop()


def test_sbatch_gets_the_services_environment_without_its_secrets(tmp_path, monkeypatch):
    """What the SLURM target hands to `sbatch` (which exports it to the job and keeps it in the
    controller's record): the service's environment less its own secrets, plus the job's. The
    `sbatch` here is a script standing in for SLURM's, recording the environment it was given;
    tests/system/test_serve_slurm.py runs the real one."""
    from scaletune.serve.jobs.dispatch.base import JobFiles
    from scaletune.serve.jobs.dispatch.slurm import SlurmDispatcher

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    seen = tmp_path / "sbatch-env.json"
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(
        f"#!{sys.executable}\nimport json, os\njson.dump(dict(os.environ), open({str(seen)!r}, 'w'))\nprint('4242')\n"
    )
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for name in (*SERVICE_SECRETS, *SERVICE_CREDENTIALS):
        monkeypatch.setenv(name, "service-own-secret")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    job = JobFiles("j1", job_dir, job_dir / "config.yaml", (), {"gpus_per_node": 0}, tmp_path, {"HF_TOKEN": "job-own"})
    assert SlurmDispatcher().submit(job) == "4242"
    env = json.loads(seen.read_text())
    assert env["HF_TOKEN"] == "job-own" and env["PATH"].startswith(str(bin_dir))  # the job's, and the service's
    assert not SERVICE_SECRETS & set(env), sorted(SERVICE_SECRETS & set(env))
    assert "service-own-secret" not in env.values(), sorted(k for k, v in env.items() if v == "service-own-secret")


SECRET = "hf_every_form_9d2b41"
# Every form an override can set a `distributed.env` secret in (issue 34, case 4: the section
# mapping used to skip the secret handling and show the value to read tokens and in the command).
FORMS = {
    "dotted": f"distributed.env.HF_TOKEN={SECRET}",
    "env mapping": f"distributed.env={{HF_TOKEN: {SECRET}, NCCL_DEBUG: WARN}}",
    "section mapping": f"distributed={{strategy: single, num_processes: 1, env: {{HF_TOKEN: {SECRET}}}}}",
    "section as JSON": json.dumps({"distributed": {"strategy": "single", "env": {"HF_TOKEN": SECRET}}}).replace(
        '{"distributed": ', "distributed=", 1
    )[:-1],
}


def test_every_override_form_keeps_the_secret_out(tiny_model_dir, tmp_path):
    """Through the one rule (`config.overrides.split_secret_override`): the service's dry run and
    the command `scaletune launch --dry-run` writes show no secret, whatever the override's form,
    and the submission still holds it for the job's environment (and not in its stored overrides)."""
    from scaletune.serve.jobs.submission import read
    from tests.helpers import run_cli

    srv = Server(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs")
    submit = create_token(srv.svc.Session, "submit")
    cfg = make_config(tiny_model_dir, tmp_path / "run")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    try:
        for form, override in FORMS.items():
            body = {"config": yaml.safe_dump(cfg), "overrides": [override], "dry_run": True}
            dry = client(srv, submit).post("/api/jobs", json=body)
            assert dry.status_code == 200, (form, dry.text)
            assert SECRET not in dry.text, (form, dry.text)
            # what the service keeps for the job's environment, and what it stores
            sub = read(yaml.safe_dump(cfg), [override], max_depth=64)
            assert sub.secrets == {"HF_TOKEN": SECRET} and SECRET not in " ".join(sub.overrides), form
            proc = run_cli(["launch", str(path), override, "--dry-run"])
            assert proc.returncode == 0, (form, proc.stderr[-2000:])
            assert SECRET not in proc.stdout + proc.stderr, (form, proc.stdout)
    finally:
        srv.stop()
