"""The job database as deployed: the `postgres://` URLs platforms give, passwords never printed,
and a real Postgres (Debian's server in a temporary folder: conftest's `postgres`) migrated and watched
through the real `scaletune serve`."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest
from sqlalchemy import create_engine, inspect, text

from scaletune.serve.jobs.db import MIGRATIONS, database_url, redacted, scrubbed
from tests.helpers import REPO_ROOT, run_cli, subprocess_env
from tests.serve.serve_helpers import PASSWORD, free_port, fresh_postgres


def test_postgres_urls_name_the_shipped_driver():
    # Written out by hand: what SQLAlchemy must be given for each URL a platform or a user writes.
    cases = {
        "postgres://u:pw@db.example:5432/jobs": "postgresql+psycopg://u:pw@db.example:5432/jobs",
        "postgresql://u:pw@db.example/jobs?sslmode=require": "postgresql+psycopg://u:pw@db.example/jobs?sslmode=require",
        "postgresql+psycopg2://u:pw@h/j": "postgresql+psycopg2://u:pw@h/j",  # a driver named: kept
        "sqlite:////var/lib/scaletune/serve.db": "sqlite:////var/lib/scaletune/serve.db",
    }
    for given, wanted in cases.items():
        assert database_url(given).render_as_string(hide_password=False) == wanted, given


def test_passwords_are_hidden_in_urls_and_errors():
    assert redacted("postgres://u:s3cret@h:5432/j") == "postgres://u:***@h:5432/j"
    assert redacted("postgresql://u:p%40ss@h/j") == "postgresql://u:***@h/j"
    assert redacted("not a url://u:s3cret@h") == "not a url://u:***@h"  # unparsable: hidden all the same
    err = RuntimeError("conninfo 'password=s3cret host=h' and p%40ss")
    assert "s3cret" not in scrubbed(err, "postgresql://u:s3cret@h/j")
    assert "p%40ss" not in scrubbed(err, "postgresql://u:p%40ss@h/j")


@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
def test_unreachable_database_fails_the_start_without_the_password(tmp_path, scheme):
    url = f"{scheme}://user:s3cret@127.0.0.1:1/x"  # nothing listens on port 1
    r = run_cli(["serve", "--db", url, "--jobs-dir", str(tmp_path), "--port", str(free_port())], timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "cannot open the job database postgresql+psycopg://user:***@127.0.0.1:1/x" in r.stderr, out
    assert "s3cret" not in out and "Traceback" not in out
    r = run_cli(["serve", "token", "create", "--db", url], timeout=120)
    assert r.returncode == 1 and "s3cret" not in r.stdout + r.stderr and "user:***@" in r.stderr


def test_migrations_run_on_postgres(postgres):
    from alembic.script import ScriptDirectory

    r = run_cli(["serve", "token", "create", "--scope", "admin", "--db", postgres["url"]], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert PASSWORD not in r.stdout + r.stderr
    head = ScriptDirectory(str(MIGRATIONS)).get_current_head()
    engine = create_engine(database_url(postgres["url"]))
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == head
            assert conn.execute(text("SELECT scope FROM tokens")).scalars().all() == ["admin"]
        tables = set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert {"jobs", "events", "metrics", "tokens", "settings", "audit", "alembic_version"} <= tables


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_tokens_made_before_names_are_named_by_the_upgrade(backend, request, tmp_path):
    """A database from before teams (migration 0003) with tokens in it: the upgrade names each
    token SCOPE-ID (so it can be listed and revoked) and keeps it working; jobs get an empty owner."""
    from alembic import command
    from alembic.config import Config as AlembicConfig

    from scaletune.serve.edge.auth import digest, identify, list_tokens
    from scaletune.serve.jobs.db import open_db

    url = f"sqlite:///{tmp_path / 'old.db'}" if backend == "sqlite" else request.getfixturevalue("postgres")["url"]
    raw = database_url(url).render_as_string(hide_password=False)
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", raw.replace("%", "%%"))
    command.upgrade(cfg, "head")
    command.downgrade(cfg, "0003")
    engine = create_engine(raw)
    try:
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM tokens"))
            for scope, value in (("read", "old-read"), ("admin", "old-admin")):
                conn.execute(
                    text("INSERT INTO tokens (hash, scope, created) VALUES (:h, :s, CURRENT_TIMESTAMP)"),
                    {"h": digest(value), "s": scope},
                )
            ids = conn.execute(text("SELECT id, scope FROM tokens ORDER BY id")).all()
    finally:
        engine.dispose()
    _, Session = open_db(url)  # the service's start: upgrades to head
    assert [(t["name"], t["scope"], t["revoked"]) for t in list_tokens(Session)] == [
        (f"{scope}-{i}", scope, None) for i, scope in ids
    ]
    assert identify(Session, "old-admin") == (f"admin-{ids[1][0]}", "admin")


MIGRATE_AT = """
import sys, time
from scaletune.serve.jobs.db import open_db
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # every process migrates at the same instant
open_db(sys.argv[1])
print("migrated")
"""


def test_services_starting_at_once_on_a_fresh_postgres_migrate_it_once(postgres):
    """Replicas of a deployment start together on an empty Postgres: each runs the migrations at
    the same instant. Without a lock, two create the same tables and one fails on Postgres's unique
    type names (the failure CI met as a replica that never answered /healthz); the migrations hold
    a transaction-scoped advisory lock, so the first migrates and the others find the head."""
    url = fresh_postgres(postgres["url"], "at_once")
    at = str(time.time() + 8)  # after the four interpreters have imported SQLAlchemy and Alembic
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MIGRATE_AT, url, at],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=subprocess_env(),
            cwd=REPO_ROOT,
        )  # fmt: skip
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    assert all("migrated" in o for o in outs), outs
    assert all(PASSWORD not in o for o in outs)


def _health(url: str, want: int, timeout: float = 60) -> dict:
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            resp = httpx.get(f"{url}/healthz", timeout=15)
            if resp.status_code == want:
                return resp.json()
            last = f"{resp.status_code} {resp.text}"
        except httpx.TransportError as exc:
            last = repr(exc)
        time.sleep(0.3)
    raise AssertionError(f"/healthz did not answer {want} in {timeout} s; last: {last}")


def test_service_on_postgres_says_how_it_starts_and_answers_healthz(postgres, tmp_path):
    port = free_port()
    err = tmp_path / "stderr"
    argv = [sys.executable, "-m", "scaletune", "serve", "--db", postgres["url"], "--port", str(port),
            "--jobs-dir", str(tmp_path / "jobs"), "--max-concurrent", "2"]  # fmt: skip
    with err.open("w") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=subprocess_env(), cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        assert _health(url, 200) == {"status": "ok"}
        line = next(ln for ln in err.read_text().splitlines() if ln.startswith("scaletune serve:"))
        pg_port = postgres["url"].rsplit(":", 1)[1].split("/")[0]
        assert re.fullmatch(
            rf"scaletune serve: {url} \| database postgresql\+psycopg://scaletune:\*\*\*@127\.0\.0\.1:{pg_port}/postgres"
            r" \| targets local, slurm, modal \| at most 2 local jobs at once",
            line,
        ), line
        postgres["pg"](*postgres["start"][:3], "-m", "fast", "stop")  # the database goes away
        assert _health(url, 503)["status"] == "unavailable"
        r = postgres["pg"](*postgres["start"], "start")
        assert r.returncode == 0, r.stderr
        assert _health(url, 200) == {"status": "ok"}  # and comes back without restarting the service
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert PASSWORD not in err.read_text()


def test_two_services_on_one_postgres_start_each_queued_job_once(postgres, tmp_path):
    """Issue 39, item 12: two `scaletune serve` on one Postgres and one jobs folder (two replicas
    of a deployment). Twenty jobs queued at once: each is started by exactly one of them, as the
    claim's conditional UPDATE decides (`watch.claim`). Each job is a record and folder whose
    config is absent, so each start is one cheap process that fails at once, and each start leaves
    one line in the job's log and one `starting` event: two starts show as two. Before the claim,
    both services read the same rows queued and started many twice."""
    from sqlalchemy import select

    from scaletune.serve.jobs.db import Event, Job
    from scaletune.serve.jobs.service import JobService
    from tests.serve.serve_helpers import plant_job

    url = fresh_postgres(postgres["url"], "claims")
    home = tmp_path / "jobs"
    procs, ports = [], [free_port(), free_port()]
    for port in ports:
        argv = [sys.executable, "-m", "scaletune", "serve", "--db", url, "--port", str(port),
                "--jobs-dir", str(home), "--max-concurrent", "20"]  # fmt: skip
        with (tmp_path / f"serve-{port}.log").open("w") as sink:  # read when it does not answer
            procs.append(subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT,
                                          env=subprocess_env(), cwd=REPO_ROOT))  # fmt: skip
    try:
        for port in ports:
            try:
                assert _health(f"http://127.0.0.1:{port}", 200) == {"status": "ok"}
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{(tmp_path / f'serve-{port}.log').read_text()[-3000:]}") from None
        svc = JobService(url, home, "http://127.0.0.1:1")  # the database's writer here; no watcher runs
        ids = [plant_job(svc, tmp_path / "runs" / f"r{i}", state="queued") for i in range(20)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with svc.Session() as s:
                states = {j.id: j.state for j in s.scalars(select(Job).where(Job.id.in_(ids)))}
            if all(st in ("failed", "succeeded") for st in states.values()):
                break
            time.sleep(0.5)
        assert set(states.values()) == {"failed"}, states  # each ended, its config missing
        with svc.Session() as s:
            starts = {
                i: sum(e.data.get("state") == "starting" for e in s.scalars(select(Event).where(Event.job_id == i)))
                for i in ids
            }
        lines = {i: (home / i / "train.log").read_text().count("config file not found") for i in ids}
        assert starts == dict.fromkeys(ids, 1), starts
        assert lines == dict.fromkeys(ids, 1), lines
        svc.engine.dispose()
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)


def test_tasks_and_policy_outlive_a_clean_stop_on_postgres(postgres, tmp_path):
    """Issue 39, item 14, on the real Postgres (tests/serve/test_durable_records.py kills the service
    on SQLite): a service stopped cleanly (uvicorn's shutdown, in-process) with a task running (held
    by SIGSTOP) and a policy `PUT`. The task is recorded `interrupted` as the service stops (the next
    service, in the same process, would not take it for a dead service's), and the next service
    applies the change over its options. Controls: the record said `running` before the stop; the
    options do not hold the change."""
    from scaletune.serve.edge.auth import create_token
    from tests.serve.serve_helpers import (
        TEST_POLICY,
        Server,
        client,
        eval_ready_job,
        held_eval_task,
        release,
        task_record,
        tasks_of,
    )

    url = fresh_postgres(postgres["url"], "durable")  # its own: the kept policy reaches no other test
    srv = Server(url, tmp_path / "jobs")
    admin = create_token(srv.svc.Session, "admin", name="admin-pg")
    job_id = eval_ready_job(srv.svc, tmp_path, "admin-pg")
    pid = None
    try:
        with client(srv, admin) as c:
            assert c.put("/api/admin/policy", json={"trusted_hosts": ["jobs.example.com"]}).status_code == 200
            held, pid = held_eval_task(c, job_id, srv.svc.Session, tmp_path / "data.jsonl")
            assert task_record(srv.svc.Session, held["id"]).state == "running"  # control
        srv.stop()
        srv.start()  # a new JobService and app on the same database
        with client(srv, admin) as c:
            (listed,) = tasks_of(c, job_id)
            got = c.get("/api/admin/policy").json()
    finally:
        srv.stop()
        srv.svc.engine.dispose()
        if pid:
            release(pid)
    assert (listed["id"], listed["state"]) == (held["id"], "interrupted"), listed
    assert "the service stopped while it ran" in listed["message"] and listed["log_tail"] is not None
    assert got["trusted_hosts"] == ["jobs.example.com"] and TEST_POLICY.trusted_hosts == ()
