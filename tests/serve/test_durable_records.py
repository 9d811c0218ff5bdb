"""What the service keeps across a restart besides its jobs (issue 39, item 14): the evaluate and
export tasks of a job and the admin's policy changes, in the job database. A task the service was
running when it stopped comes back `interrupted` with why, never `running` for ever: here the
service (`scaletune serve`, a subprocess) is killed; tests/serve/test_db.py stops one cleanly on
the real Postgres. The task records hold no token and no secret.

Cheap by design: no model is trained or loaded. The tasks are `scaletune eval` on a planted job
whose `final/` holds no model, which fails in about a second; a task meant to be running at the
stop is held with SIGSTOP, so it cannot end first."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
from sqlalchemy import text

from scaletune.serve.edge.auth import create_token
from scaletune.serve.jobs.service import JobService
from tests.helpers import REPO_ROOT, subprocess_env, wait_for
from tests.serve.serve_helpers import (
    TEST_POLICY,
    Server,
    client,
    eval_ready_job,
    free_port,
    held_eval_task,
    release,
    task_record,
    tasks_of,
    wait_serving,
)

SECRET_VAR, SECRET = "SCALETUNE_TEST_HF_TOKEN", "hf_durable-records-secret-value"
TERM = 1 << (signal.SIGTERM - 1)  # its bit in /proc/PID/status's masks


def wait_ended(c: httpx.Client, job_id: str, task_id: str) -> dict:
    found: dict = {}

    def ended() -> bool:
        found.update(next(t for t in tasks_of(c, job_id) if t["id"] == task_id))
        return found["state"] != "running"

    wait_for(ended, 60, f"task {task_id}")
    return found


def stored_text(Session) -> str:  # noqa: N803
    """Every value of the tasks and settings tables, as text."""
    with Session() as s:
        rows = [*s.execute(text("SELECT * FROM tasks")), *s.execute(text("SELECT * FROM settings"))]
    return "\n".join(repr(tuple(r)) for r in rows)


def test_tasks_and_policy_outlive_a_killed_service(tmp_path):
    """`scaletune serve` killed (SIGKILL: nothing of it runs after) with a finished task (failed,
    with its output's tail), a task running and a PUT policy change: the next service on the SQLite
    file lists the finished task as it was, the running one `interrupted` (its orphaned process
    ended: it would write a result nobody records) and applies the policy change over its own
    options. Controls: the record said `running` when the service died (the new service changed
    it); the options do not hold the change; the held task's process did hold the job's secret
    (the records do not)."""
    db, home = f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs"
    seed = JobService(db, home, "http://127.0.0.1:9")  # the records the killed service starts with
    admin = create_token(seed.Session, "admin", name="admin")
    done_job, held_job = eval_ready_job(seed, tmp_path, "admin"), eval_ready_job(seed, tmp_path, "admin")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "scaletune", "serve", "--db", db, "--jobs-dir", str(home), "--port", str(port),
            "--read-root", str(tmp_path), "--job-secret", f"*:HF_TOKEN={SECRET_VAR}"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=subprocess_env(**{SECRET_VAR: SECRET}), cwd=REPO_ROOT)  # fmt: skip
    pid = None
    try:
        wait_serving(proc, url)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=60) as c:
            change = {"max_upload_bytes": 12345, "env_prefixes": ["MY_TEAM_"]}
            assert c.put("/api/admin/policy", json=change).status_code == 200
            r = c.post(f"/api/jobs/{done_job}/tasks/eval", json={"data": str(tmp_path / "data.jsonl")})
            assert r.status_code == 202, r.text
            done = wait_ended(c, done_job, r.json()["id"])
            held, pid = held_eval_task(c, held_job, seed.Session, tmp_path / "data.jsonl")
        assert f"HF_TOKEN={SECRET}".encode() in Path(f"/proc/{pid}/environ").read_bytes()  # control
        proc.kill()
        proc.wait(timeout=30)
        assert task_record(seed.Session, held["id"]).state == "running"  # control: what the killed service left
        assert not pending(pid) & TERM  # control: nobody asked the held process to end yet
        srv = Server(db, home)  # TEST_POLICY: its own options
        try:
            with client(srv, admin) as c:
                after = {t["id"]: t for j in (done_job, held_job) for t in tasks_of(c, j)}
                got = c.get("/api/admin/policy").json()
        finally:
            srv.stop()
            srv.svc.engine.dispose()
        ended = pending(pid) & TERM  # sent by the new service; delivered once the process goes on
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid:
            release(pid)
    assert done["state"] == "failed" and done["message"] == "exit code 2" and done["log_tail"], done
    assert after[done["id"]] == done  # the same record, its tail read from the job's folder
    interrupted = after[held["id"]]
    assert (interrupted["state"], interrupted["owner"]) == ("interrupted", "admin"), interrupted
    assert "the service stopped while it ran" in interrupted["message"] and interrupted["ended"]
    assert ended, "the orphaned task's process was not ended"
    assert (got["max_upload_bytes"], got["env_prefixes"]) == (12345, ["MY_TEAM_"])
    assert TEST_POLICY.max_upload_bytes != 12345 and TEST_POLICY.env_prefixes == ()  # control: not the options'
    assert got["read_roots"] == list(TEST_POLICY.read_roots)  # the rest: the new service's options
    stored = stored_text(seed.Session)
    assert done["id"] in stored and "MY_TEAM_" in stored and SECRET not in stored and admin not in stored
    seed.engine.dispose()


def pending(pid: int) -> int:
    """The signals sent to `pid` and not delivered yet (a stopped process holds them), as a mask."""
    status = dict(ln.split(":\t", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in ln)
    return int(status["ShdPnd"], 16) | int(status["SigPnd"], 16)
