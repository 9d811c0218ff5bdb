"""Secrets submitted with a job survive a restart without landing in plain text (issue 39, item 13;
serve/jobs/vault.py), on SQLite and on the real Postgres (conftest's `postgres`).

The service is the real `scaletune serve`, a process of its own, killed with SIGKILL (nothing of it
runs after) and started again on the same database: nothing but the database carries a secret from
one service to the next. A job is submitted with two secrets (HF_TOKEN in the config, WANDB_API_KEY
as an override) while a planted `running` record holds the only local slot, so it stays queued across
the restarts; the planted job is cancelled when the test lets the queue move. The job's process is its
real `scaletune train` on the tiny model: its environment is read from /proc once it has a PID, then
the job is cancelled (nothing trains to the end).

Every byte the tests can reach is searched for the secret values and the keys: the SQLite files
(database, WAL, shared memory) or `pg_dump`'s dump of the Postgres database, each service's output,
every file of the jobs folder and the run directory, the API's answers, the job's event stream and
its page."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from cryptography.fernet import Fernet
from sqlalchemy import select

from scaletune.errors import UserError
from scaletune.serve.edge.auth import create_token
from scaletune.serve.jobs.db import Event, Job
from scaletune.serve.jobs.service import JobService
from scaletune.serve.jobs.vault import KEY_ENV, Vault
from tests.helpers import REPO_ROOT, make_config, run_cli, subprocess_env, wait_for
from tests.serve.serve_helpers import (
    TEST_POLICY,
    client,
    database_bytes,
    free_port,
    fresh_postgres,
    plant_job,
    read_events,
)

KEY, OTHER_KEY = Fernet.generate_key().decode(), Fernet.generate_key().decode()
HF, WANDB = "hf_vault_4c1d9e77a2f0", "wandb_vault_b80e31f5c6"
HF_AGAIN, WANDB_AGAIN = "hf_given_again_91aa0c3e", "wandb_given_again_5d72e1b0"
NEVER_STORED = {"HF_TOKEN": HF, "WANDB_API_KEY": WANDB, "HF_TOKEN again": HF_AGAIN, "WANDB_API_KEY again": WANDB_AGAIN}
NEVER_STORED |= {"the key": KEY, "the other key": OTHER_KEY}


class Database:
    """A fresh job database: its URL and every byte of it (`dump`)."""

    def __init__(self, backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
        if backend == "sqlite":
            self.url = f"sqlite:///{tmp_path / 'jobs.sqlite'}"
            return
        self.url = fresh_postgres(request.getfixturevalue("postgres")["url"], f"vault_{uuid.uuid4().hex[:8]}")

    def dump(self) -> bytes:
        """Every byte of the database (`serve_helpers.database_bytes`)."""
        return database_bytes(self.url)


@pytest.fixture(params=["sqlite", "postgres"])
def database(request, tmp_path) -> Database:
    return Database(request.param, tmp_path, request)


class Serve:
    """`scaletune serve` on `db` as a process, with the secrets key `key` (None: none) in its
    environment; everything it prints goes to `logs`/serve-N.log."""

    def __init__(self, db: str, home: Path, logs: Path, key: str | None) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = logs / f"serve-{len(list(logs.glob('serve-*.log')))}.log"
        roots = [a for root in TEST_POLICY.read_roots for a in ("--read-root", root)]
        argv = [sys.executable, "-m", "scaletune", "serve", "--db", db, "--jobs-dir", str(home), "--port", str(port),
                *roots, "--write-root", tempfile.gettempdir()]  # fmt: skip
        with self.log.open("w") as sink:
            self.proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                         env=subprocess_env(**{KEY_ENV: key}))  # fmt: skip
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/healthz", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def submit(c: httpx.Client, model: Path, run_dir: Path) -> str:
    """A queued job with two secrets: HF_TOKEN in its config, WANDB_API_KEY as an override."""
    cfg = make_config(model, run_dir)
    cfg["training"].update(max_steps=400, save_every=0)  # runs long enough to be looked at
    cfg["distributed"]["env"] = {"HF_TOKEN": HF}
    body = {"config": yaml.safe_dump(cfg), "overrides": [f"distributed.env.WANDB_API_KEY={WANDB}"]}
    r = c.post("/api/jobs", json=body)
    assert r.status_code == 201 and r.json()["state"] == "queued", r.text
    return r.json()["id"]


def record(seed: JobService, job_id: str) -> Job:
    with seed.Session() as s:
        return s.get(Job, job_id)


def started(c: httpx.Client, job_id: str) -> tuple[dict[str, str], int]:
    """The environment of the job's process, read as soon as it has a PID, and the PID."""

    def pid() -> int | None:
        job = c.get(f"/api/jobs/{job_id}").json()
        assert job["state"] in ("queued", "starting", "running"), job
        return int(job["target_id"]) if job["target_id"] else None

    found = wait_for(pid, 120, f"job {job_id} to start")
    return psutil.Process(found).environ(), found


def cancel(c: httpx.Client, job_id: str, pid: int | None = None) -> None:
    r = c.post(f"/api/jobs/{job_id}/cancel")
    assert r.status_code == 200, r.text

    def gone() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    if pid is not None:
        wait_for(gone, 60, f"the process of job {job_id} to end")


def assert_nowhere(db: Database, home: Path, logs: Path, *answers: str) -> None:
    """No secret value and no key in the database's bytes, the services' output, the jobs' and run
    folders' files or the answers."""
    places = {"the database": db.dump(), "the answers": "\n".join(answers).encode()}
    for root in (home, logs, home.parent / "run"):
        places |= {str(f): f.read_bytes() for f in root.rglob("*") if f.is_file()}
    found = [
        f"{name} in {where}" for where, data in places.items() for name, v in NEVER_STORED.items() if v.encode() in data
    ]
    assert not found, found
    searched = sorted(Path(w).name for w in places)
    assert "config.yaml" in searched and "serve-0.log" in searched, searched  # control: the files were there


def test_secrets_are_sealed_and_a_changed_key_holds_the_job(database, tiny_model_dir, tmp_path):
    """With SCALETUNE_SECRETS_KEY: the queued job's secrets are sealed on its record (the key opens
    them; the dump holds the sealed text, never the values). Restarted with another key, the job
    `needs_secrets`, the message naming the cause and the variables; the sealed copy is kept.
    Restarted with the right key, it is queued again, starts once the slot is free and its process
    has both secrets (and not the key); cancelled, the sealed copy is deleted."""
    home, logs = tmp_path / "jobs", tmp_path / "logs"
    logs.mkdir()
    seed = JobService(database.url, home, "http://127.0.0.1:9")  # the test's reader and writer; no watcher
    alice, admin = create_token(seed.Session, "submit", name="alice"), create_token(seed.Session, "admin", name="admin")
    blocker = plant_job(seed, tmp_path / "blocker", state="running", owner="admin")  # holds the one slot
    services: list[Serve] = []
    try:
        services.append(Serve(database.url, home, logs, KEY))
        with client(services[-1], alice) as c:
            job_id = submit(c, tiny_model_dir, tmp_path / "run")
        sealed = record(seed, job_id).sealed_secrets
        values = {"HF_TOKEN": HF, "WANDB_API_KEY": WANDB}
        assert sealed and json.loads(Fernet(KEY).decrypt(sealed.encode())) == {"job": job_id, "values": values}
        assert sealed.encode() in database.dump()  # control: the dump holds the record
        assert_nowhere(database, home, logs)
        services[-1].kill()

        services.append(Serve(database.url, home, logs, OTHER_KEY))  # the key changed
        with client(services[-1], alice) as c:
            waiting = c.get(f"/api/jobs/{job_id}").json()
        services[-1].kill()
        assert (waiting["state"], waiting["reason"], waiting["target_id"]) == (
            "needs_secrets",
            "wrong secrets key",
            None,
        )
        message = waiting["message"]
        assert f"{KEY_ENV} does not open the copy of its secrets (HF_TOKEN, WANDB_API_KEY)" in message, message
        assert "the key changed since it was submitted" in message and f"PUT /api/jobs/{job_id}/secrets" in message
        assert record(seed, job_id).sealed_secrets == sealed  # kept: the right key opens it again

        services.append(Serve(database.url, home, logs, KEY))
        with client(services[-1], admin) as c:
            assert c.get(f"/api/jobs/{job_id}").json()["state"] == "queued"
            assert c.post(f"/api/jobs/{blocker}/cancel").status_code == 200
            env, pid = started(c, job_id)
            cancel(c, job_id, pid)
            answers = [c.get(f"/api/jobs/{job_id}").text, c.get("/api/jobs").text]
            answers += [json.dumps(read_events(c, job_id, lambda kind, data: kind == "end"))]
        services[-1].kill()
    finally:
        for srv in services:
            srv.kill()
    assert (env.get("HF_TOKEN"), env.get("WANDB_API_KEY")) == (HF, WANDB)
    assert KEY_ENV not in env and KEY not in env.values()  # the service's key never reaches a job
    assert record(seed, job_id).sealed_secrets is None  # the job ended: its stored secrets with it
    assert "opens its stored secrets: queued again" in answers[-1]
    assert_nowhere(database, home, logs, *answers)
    seed.engine.dispose()


def test_without_a_key_a_queued_job_waits_for_its_secrets(database, tiny_model_dir, tmp_path):
    """Without the key: nothing is stored (memory only). After a restart the queued job
    `needs_secrets` (reason `secrets not kept`; its page says so and how to give them) and is not
    started when the slot frees. Another submit token may not give them (403); a missing or a
    foreign name is refused (422, no value in the answer); its owner's complete answer queues it,
    and its process starts with the values given again."""
    home, logs = tmp_path / "jobs", tmp_path / "logs"
    logs.mkdir()
    seed = JobService(database.url, home, "http://127.0.0.1:9")
    alice, bob = create_token(seed.Session, "submit", name="alice"), create_token(seed.Session, "submit", name="bob")
    admin = create_token(seed.Session, "admin", name="admin")
    blocker = plant_job(seed, tmp_path / "blocker", state="running", owner="admin")
    services: list[Serve] = []
    try:
        services.append(Serve(database.url, home, logs, None))
        with client(services[-1], alice) as c:
            job_id = submit(c, tiny_model_dir, tmp_path / "run")
        assert record(seed, job_id).sealed_secrets is None
        assert_nowhere(database, home, logs)
        services[-1].kill()

        services.append(Serve(database.url, home, logs, None))
        with client(services[-1], alice) as c, client(services[-1], bob) as b, client(services[-1], admin) as a:
            waiting = c.get(f"/api/jobs/{job_id}").json()
            page = c.get(f"/jobs/{job_id}").text
            assert a.post(f"/api/jobs/{blocker}/cancel").status_code == 200
            time.sleep(3)  # six watcher ticks with a free slot
            still = c.get(f"/api/jobs/{job_id}").json()
            with seed.Session() as s:
                states = [
                    e.data["state"] for e in s.scalars(select(Event).where(Event.job_id == job_id)) if e.kind == "state"
                ]
            url = f"/api/jobs/{job_id}/secrets"
            foreign = b.put(url, json={"secrets": {"HF_TOKEN": HF_AGAIN, "WANDB_API_KEY": WANDB_AGAIN}})
            short = c.put(url, json={"secrets": {"HF_TOKEN": HF_AGAIN}})
            extra = c.put(url, json={"secrets": {"HF_TOKEN": HF_AGAIN, "WANDB_API_KEY": WANDB_AGAIN, "PATH": "/x"}})
            given = c.put(url, json={"secrets": {"HF_TOKEN": HF_AGAIN, "WANDB_API_KEY": WANDB_AGAIN}})
            env, pid = started(c, job_id)
            again = c.put(url, json={"secrets": {"HF_TOKEN": HF_AGAIN, "WANDB_API_KEY": WANDB_AGAIN}})
            cancel(c, job_id, pid)
            history = c.get(f"/api/jobs/{job_id}/history").text
            answers = [foreign.text, short.text, extra.text, given.text, again.text, history, page]
            answers += [json.dumps(read_events(c, job_id, lambda kind, data: kind == "end"))]
        services[-1].kill()
    finally:
        for srv in services:
            srv.kill()
    assert (waiting["state"], waiting["reason"], waiting["target_id"]) == ("needs_secrets", "secrets not kept", None)
    assert "its secrets (HF_TOKEN, WANDB_API_KEY) were held in the memory of the service" in waiting["message"]
    assert f"no {KEY_ENV}" in waiting["message"], waiting["message"]
    assert "needs its secrets again" in page and f"api/jobs/{job_id}/secrets" in page
    assert (still["state"], still["target_id"]) == ("needs_secrets", None) and "starting" not in states, (still, states)
    assert foreign.status_code == 403, foreign.text
    assert short.status_code == 422 and "WANDB_API_KEY: missing" in short.text, short.text
    assert extra.status_code == 422 and "PATH: not a secret this job was submitted with" in extra.text, extra.text
    assert given.status_code == 200 and given.json()["state"] in ("queued", "starting", "running"), given.text
    assert again.status_code == 409, again.text  # a job that no longer waits for them
    assert (env.get("HF_TOKEN"), env.get("WANDB_API_KEY")) == (HF_AGAIN, WANDB_AGAIN)
    assert "job.secrets" in history and "given again: HF_TOKEN, WANDB_API_KEY" in history
    assert_nowhere(database, home, logs, *answers)
    seed.engine.dispose()


def test_the_vault_seals_per_job_and_rotates_keys(tmp_path):
    """Without a service: a sealed copy opens only on its own job's record (one moved onto another
    record does not), under its key or a rotation that lists it; a key that is none is refused
    naming the variable, never its value, by the vault and by `scaletune serve` (exit 2)."""
    job = Job(id="job-a", secret_refs=["HF_TOKEN"], sealed_secrets=None)
    other = Job(id="job-b", secret_refs=["HF_TOKEN"], sealed_secrets=None)
    Vault({KEY_ENV: KEY}).seal(job, {"HF_TOKEN": HF})
    other.sealed_secrets = job.sealed_secrets
    rotated = Vault({KEY_ENV: f"{OTHER_KEY}, {KEY}"})  # a new key first, the old one still opening
    assert rotated.missing(job) is None and rotated.held("job-a") == {"HF_TOKEN": HF}
    assert rotated.missing(other)[0] == "wrong secrets key"
    assert Vault({KEY_ENV: OTHER_KEY}).missing(job)[0] == "wrong secrets key"
    assert Vault({}).missing(job)[0] == "no secrets key"
    bad = "not-a-fernet-key-but-secret-7d1c"
    with pytest.raises(UserError) as caught:
        Vault({KEY_ENV: bad})
    assert KEY_ENV in str(caught.value) and bad not in str(caught.value)
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    r = run_cli(["serve", "--db", db, "--jobs-dir", str(tmp_path / "jobs"), "--port", str(free_port())],
                env={KEY_ENV: bad}, timeout=120)  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{KEY_ENV}: its value is not a Fernet key" in r.stderr and bad not in r.stdout + r.stderr


def test_a_clone_takes_its_owners_secrets_and_never_starts_without_them(server, tiny_model_dir, tmp_path):
    """A job's stored config holds no secret, so a clone used to start without them. Now (on the
    real service, the only slot held by a planted running job): another submit token's clone is
    refused naming each secret and how to give it, nothing made; the owner's clone carries the
    values the service still holds, and its process starts with them once the slot frees (its
    original cancelled first, which drops the original's copy); a clone of the cancelled job is
    refused as no longer held, and taken with the values given as its overrides."""
    alice = server.submit
    bob = create_token(server.svc.Session, "submit", name="clone-bob")
    blocker = plant_job(server.svc, tmp_path / "blocker", state="running", owner="admin")
    with client(server, alice) as c, client(server, bob) as b, client(server, server.admin) as a:
        job_id = submit(c, tiny_model_dir, tmp_path / "run")
        before = {j["id"] for j in a.get("/api/jobs").json()}
        foreign = b.post(f"/api/jobs/{job_id}/clone", json={"overrides": [f"output_dir={tmp_path / 'bobs'}"]})
        assert {j["id"] for j in a.get("/api/jobs").json()} == before  # nothing made
        own = c.post(f"/api/jobs/{job_id}/clone", json={"overrides": [f"output_dir={tmp_path / 'clone'}"]})
        assert own.status_code == 201 and own.json()["state"] == "queued", own.text
        clone_id = own.json()["id"]
        assert record(server.svc, clone_id).secret_refs == ["HF_TOKEN", "WANDB_API_KEY"]
        cancel(c, job_id)  # the original's copy is dropped; the clone holds its own
        assert a.post(f"/api/jobs/{blocker}/cancel").status_code == 200
        env, pid = started(c, clone_id)
        cancel(c, clone_id, pid)
        gone = c.post(f"/api/jobs/{job_id}/clone", json={"overrides": [f"output_dir={tmp_path / 'gone'}"]})
        assert gone.status_code == 422, gone.text
        given = [f"distributed.env.HF_TOKEN={HF_AGAIN}", f"distributed.env.WANDB_API_KEY={WANDB_AGAIN}"]
        late = c.post(f"/api/jobs/{job_id}/clone", json={"overrides": [f"output_dir={tmp_path / 'late'}", *given]})
        assert late.status_code == 201, late.text
        late_env, late_pid = started(c, late.json()["id"])
        cancel(c, late.json()["id"], late_pid)
    assert foreign.status_code == 422, foreign.text
    said = foreign.json()["problems"][0]
    assert "secrets (HF_TOKEN, WANDB_API_KEY) its clone cannot take: they are" in said, said
    assert "distributed.env.HF_TOKEN=VALUE distributed.env.WANDB_API_KEY=VALUE" in said
    assert (env.get("HF_TOKEN"), env.get("WANDB_API_KEY")) == (HF, WANDB)
    assert gone.status_code == 422 and "this service no longer holds them" in gone.text, gone.text
    assert (late_env.get("HF_TOKEN"), late_env.get("WANDB_API_KEY")) == (HF_AGAIN, WANDB_AGAIN)
    answers = (foreign.text, own.text, gone.text, late.text)
    assert not [v for v in NEVER_STORED.values() for text in answers if v in text]
