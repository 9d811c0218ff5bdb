"""Deleting (issue 39, item 8): a job with its rows and folders, a data file and an export, by the
owner or an admin only, refused while a job runs, never following a link out of the service's run
folders, each deletion in the audit; the checkpoints retention (`keep_checkpoints_days`) by the real
sweep on real files, with a fake clock and through the running service's own periodic sweep. The API
tests run against a real service on SQLite and on the real Postgres (conftest's `postgres`, whose
foreign keys are enforced: a job's `tasks` rows must go first). One Chromium test walks the page's
Delete buttons and their confirmations."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import delete, func, select, text, update
from sqlalchemy.exc import IntegrityError

from scaletune.serve.edge.auth import create_token, identify
from scaletune.serve.edge.policy import Policy
from scaletune.serve.jobs import retention
from scaletune.serve.jobs.db import Event, Job, Metric, TaskRecord
from scaletune.serve.jobs.dispatch.base import start_mark
from scaletune.serve.jobs.service import JobService
from tests.helpers import wait_for
from tests.serve.serve_helpers import TEST_POLICY, Server, client, dom, fresh_postgres

RECORD = b'{"instruction": "Say hi.", "input": "", "output": "Hi."}\n'
DAY = 86400.0


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def team(request, module_tmp_path):
    """A service whose run folders are its jobs folder and one write root (`ROOT/runs`; the rest of
    the temporary folder is outside them), its own sweep every 0.5 s; tokens: admin `ops`, submit
    `alice` and `bob`, read `carol`."""
    root = module_tmp_path / request.param
    (root / "runs").mkdir(parents=True)
    if request.param == "sqlite":
        url = f"sqlite:///{root / 'serve.db'}"
    else:
        url = fresh_postgres(request.getfixturevalue("postgres")["url"], "deletes")
    policy = Policy(read_roots=TEST_POLICY.read_roots, write_roots=(str(root / "runs"),))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(retention, "SWEEP_EVERY_S", 0.5)  # read when the app is made
        srv = Server(url, root / "jobs", policy=policy)
    srv.root, srv.backend = root, request.param
    people = (("ops", "admin"), ("alice", "submit"), ("bob", "submit"), ("carol", "read"))
    srv.tokens = {name: create_token(srv.svc.Session, scope, name=name) for name, scope in people}
    yield srv
    srv.stop()
    srv.svc.engine.dispose()


def as_(srv, name: str):
    return client(srv, srv.tokens[name])


def plant(svc: JobService, owner: str, state: str = "succeeded", *, run_dir: Path | None = None,
          job_id: str | None = None, fill: bool = True, rows: bool = True, **fields) -> tuple[str, Path, Path]:  # fmt: skip
    """A job record with its job folder (config, log) and, with `fill`, a run folder as a finished
    run leaves it: checkpoints/step-1 and step-2, final/, metrics.jsonl and an export exports/E; with
    `rows`, an event, a metric and the export's task row (tasks refer to jobs by a foreign key).
    Default run folder: JOB/runs/r, as the service places a relative output_dir."""
    job_id = job_id or uuid.uuid4().hex[:12]
    job_dir = svc.home / job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "config.yaml").write_text("output_dir: runs/r\n")
    (job_dir / "train.log").write_text("[scaletune] done\n")
    run = run_dir or job_dir / "runs" / "r"
    if fill:
        for part in ("checkpoints/step-1", "checkpoints/step-2", "final", "exports/E"):
            (run / part).mkdir(parents=True, exist_ok=True)
        for step in (1, 2):
            (run / "checkpoints" / f"step-{step}" / "progress.json").write_text(json.dumps({"step": step}))
        (run / "checkpoints" / "latest").write_text("step-2\n")
        (run / "final" / "model.safetensors").write_bytes(b"final")
        (run / "exports" / "E" / "model.safetensors").write_bytes(b"export")
        (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with svc.Session() as s:
        s.add(Job(id=job_id, name=run.name, state=state, target=fields.pop("target", "local"), config_yaml="",
                  job_dir=str(job_dir), run_dir=str(run), token_hash="", owner=owner, **fields))  # fmt: skip
        s.flush()
        if rows:
            t = time.time()
            for step in (1, 2):
                path = str(run / "checkpoints" / f"step-{step}")
                s.add(Event(job_id=job_id, kind="checkpoint", data={"step": step, "path": path}))
            s.add(Metric(job_id=job_id, step=1, kind="train", loss=1.0, data={"step": 1, "loss": 1.0}))
            result = {"path": "exports/E", "archive": f"api/jobs/{job_id}/archive/exports/E"}
            s.add(TaskRecord(id=uuid.uuid4().hex[:10], job_id=job_id, kind="export", what="final -> exports/E",
                             owner=owner, state="succeeded", result=result, started=t, ended=t, seen=t))  # fmt: skip
        s.commit()
    return job_id, job_dir, run


def counts(svc: JobService, job_id: str) -> dict[str, int]:
    """The rows that refer to the job, per table, and the job's own."""
    with svc.Session() as s:
        return {
            model.__tablename__: s.scalar(select(func.count()).select_from(model).where(col == job_id))
            for model, col in ((Job, Job.id), (TaskRecord, TaskRecord.job_id), (Event, Event.job_id), (Metric, Metric.job_id))
        }  # fmt: skip


def audit(srv, **query) -> list[tuple[str, str, str]]:
    """(actor, action, detail) of the audit rows, oldest first, as an admin reads them."""
    rows = as_(srv, "ops").get("/api/audit", params=query).json()
    return [(a["actor"], a["action"], a["detail"]) for a in reversed(rows)]


def outside_folder(srv, name: str) -> Path:
    """A folder outside the service's run folders, with a file in it."""
    folder = srv.root / "outside" / name
    folder.mkdir(parents=True)
    (folder / "keep.txt").write_text("not the service's")
    return folder


# -- jobs ------------------------------------------------------------------------------------------
def test_the_owner_deletes_an_ended_job_its_rows_first_and_its_folders(team):
    job_id, job_dir, run = plant(team.svc, "alice")
    alice, bob, carol = as_(team, "alice"), as_(team, "bob"), as_(team, "carol")
    refused = bob.delete(f"/api/jobs/{job_id}")
    assert refused.status_code == 403 and "belongs to alice" in refused.json()["detail"], refused.text
    assert carol.delete(f"/api/jobs/{job_id}").status_code == 403  # a read token deletes nothing
    assert alice.delete("/api/jobs/nosuchjob").status_code == 404
    before = counts(team.svc, job_id)
    assert before == {"jobs": 1, "tasks": 1, "events": 2, "metrics": 1}, before  # control: all there
    if team.backend == "postgres":  # control: the foreign key holds the job while a task row refers to it
        with team.svc.Session() as s, pytest.raises(IntegrityError):
            s.execute(delete(Job).where(Job.id == job_id))
            s.commit()
    r = alice.delete(f"/api/jobs/{job_id}")
    assert r.status_code == 200, r.text
    assert r.json() == {"deleted": f"job {job_id}", "removed": [str(job_dir)], "kept": []}
    assert counts(team.svc, job_id) == {"jobs": 0, "tasks": 0, "events": 0, "metrics": 0}
    assert not job_dir.exists() and not run.exists()
    assert alice.get(f"/api/jobs/{job_id}").status_code == 404
    assert job_id not in {j["id"] for j in alice.get("/api/jobs").json()}
    assert alice.delete(f"/api/jobs/{job_id}").status_code == 404  # once
    (row,) = audit(team, job_id=job_id)  # the refusals recorded nothing
    assert row[:2] == ("alice", "job.delete") and "succeeded" in row[2] and str(job_dir) in row[2], row


def test_an_admin_deletes_anothers_job_and_its_run_folder_in_a_write_root(team):
    job_id, job_dir, run = plant(team.svc, "bob", run_dir=team.root / "runs" / f"bob-{uuid.uuid4().hex[:6]}")
    assert run.is_dir() and not run.is_relative_to(job_dir)
    r = as_(team, "ops").delete(f"/api/jobs/{job_id}")
    assert r.status_code == 200, r.text
    assert r.json()["removed"] == [str(job_dir), str(run)] and r.json()["kept"] == []
    assert not job_dir.exists() and not run.exists() and (team.root / "runs").is_dir()
    assert [a[:2] for a in audit(team, job_id=job_id)] == [("ops", "job.delete")]


@pytest.mark.parametrize("state", ["running", "starting", "checking", "stopping"])
def test_a_job_that_has_not_ended_is_refused_until_cancelled(team, state):
    job_id, job_dir, run = plant(team.svc, "alice", state=state)  # no target id: the watcher leaves it be
    for who in ("alice", "ops"):
        r = as_(team, who).delete(f"/api/jobs/{job_id}")
        assert r.status_code == 409, r.text
        (line,) = r.json()["problems"]
        assert line.startswith(f"job {job_id} is {state}: only an ended job") and "cancel it first" in line, line
    assert job_dir.is_dir() and run.is_dir() and counts(team.svc, job_id)["jobs"] == 1
    assert as_(team, "alice").post(f"/api/jobs/{job_id}/cancel").status_code == 200
    assert as_(team, "alice").delete(f"/api/jobs/{job_id}").status_code == 200
    assert [a[:2] for a in audit(team, job_id=job_id)] == [("alice", "job.cancel"), ("alice", "job.delete")]


def test_a_cancelled_job_whose_process_runs_or_with_a_task_running_is_refused(team):
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        job_id, job_dir, _ = plant(team.svc, "alice", state="cancelled", target_id=str(sleeper.pid))
        # as the local dispatcher records its process: PID and start mark
        (job_dir / "process").write_text(f"{sleeper.pid} {start_mark(sleeper.pid)}\n")
        r = as_(team, "alice").delete(f"/api/jobs/{job_id}")
        assert r.status_code == 409 and f"its process {sleeper.pid} still runs" in r.json()["problems"][0], r.text
    finally:
        sleeper.kill()
        sleeper.wait()
    assert as_(team, "alice").delete(f"/api/jobs/{job_id}").status_code == 200  # the process ended
    busy, busy_dir, _ = plant(team.svc, "alice")
    with team.svc.Session() as s:  # a task of this very service, alive (the sweep leaves it running)
        t = time.time()
        s.add(TaskRecord(id=uuid.uuid4().hex[:10], job_id=busy, kind="eval", what="x", state="running", started=t,
                         seen=t, host=socket.gethostname()[:255], service=f"{os.getpid()}:{start_mark(os.getpid())}"))  # fmt: skip
        s.commit()
    r = as_(team, "alice").delete(f"/api/jobs/{busy}")
    assert r.status_code == 409 and "has a task running (eval)" in r.json()["problems"][0], r.text
    assert busy_dir.is_dir()


def test_links_out_of_the_run_folders_are_never_followed(team):
    alice = as_(team, "alice")
    # The job folder's runs/ is a link out: the link goes with the job folder, what it names stays.
    a = outside_folder(team, "a")
    job_id = uuid.uuid4().hex[:12]
    (team.svc.home / job_id).mkdir()
    (team.svc.home / job_id / "runs").symlink_to(a)
    (a / "r" / "final").mkdir(parents=True)
    job_id, job_dir, _ = plant(
        team.svc, "alice", job_id=job_id, run_dir=team.svc.home / job_id / "runs" / "r", fill=False
    )
    r = alice.delete(f"/api/jobs/{job_id}")
    assert r.status_code == 200, r.text
    assert not job_dir.exists() and (a / "keep.txt").is_file() and (a / "r" / "final").is_dir()
    assert any("reached through a link out of the job folder" in k for k in r.json()["kept"]), r.json()
    # The run folder is a link in the write root to a folder outside: the link is removed, not followed.
    b = outside_folder(team, "b")
    link = team.root / "runs" / f"link-{job_id}"
    link.symlink_to(b)
    job_id, _, _ = plant(team.svc, "alice", run_dir=link, fill=False)
    r = alice.delete(f"/api/jobs/{job_id}")
    assert r.status_code == 200 and not os.path.lexists(link) and (b / "keep.txt").is_file(), r.text
    assert f"{link} (a link: what it names, {b}, is kept)" in r.json()["removed"]
    # A run folder outside every run folder (a write root since removed): kept, and said.
    c = outside_folder(team, "c")
    job_id, _, _ = plant(team.svc, "alice", run_dir=c, fill=False)
    r = alice.delete(f"/api/jobs/{job_id}")
    assert r.status_code == 200 and (c / "keep.txt").is_file(), r.text
    assert r.json()["kept"] == [
        f"{c}: outside the service's run folders (the jobs folder and the write roots); not deleted"
    ]
    # A link inside the run folder (a checkpoint) to a folder outside: unlinked with the folder, its target kept.
    d = outside_folder(team, "d")
    job_id, job_dir, run = plant(team.svc, "alice")
    (run / "checkpoints" / "step-9").symlink_to(d)
    assert alice.delete(f"/api/jobs/{job_id}").status_code == 200
    assert not job_dir.exists() and (d / "keep.txt").is_file()


def test_a_modal_and_a_slurm_job_say_what_stays_at_the_target(team):
    modal_id, modal_dir, _ = plant(team.svc, "alice", target="modal", target_id="fc-1", exit_code=0,
                                   resources={"volume": "vol"})  # fmt: skip
    r = as_(team, "alice").delete(f"/api/jobs/{modal_id}")
    assert r.status_code == 200 and not modal_dir.exists(), r.text
    (kept,) = r.json()["kept"]
    assert (
        "on Modal, not deleted" in kept
        and "modal volume rm vol r -r" in kept
        and f"modal app stop scaletune-{modal_id}" in kept
    )
    slurm_id, _, _ = plant(team.svc, "alice", target="slurm", target_id="4242", exit_code=0)
    r = as_(team, "alice").delete(f"/api/jobs/{slurm_id}")
    assert r.status_code == 200 and r.json()["kept"] == [
        "on SLURM, not deleted: the cluster's own record of job 4242 (sacct), which SLURM keeps"
    ], r.text


# -- data files and exports ------------------------------------------------------------------------
def test_data_files_are_deleted_by_their_uploader_or_an_admin(team):
    alice, bob, ops = as_(team, "alice"), as_(team, "bob"), as_(team, "ops")
    for who, name in ((alice, "alice.jsonl"), (bob, "bob.jsonl")):
        assert who.post("/api/data", params={"name": name}, content=RECORD).status_code == 201
    listed = {f["name"]: f for f in alice.get("/api/data").json()}
    assert listed["alice.jsonl"]["by"] == "alice" and listed["bob.jsonl"]["by"] == "bob"
    path = Path(listed["alice.jsonl"]["path"])
    r = bob.delete("/api/data/alice.jsonl")
    assert r.status_code == 403 and "uploaded by alice" in r.json()["detail"], r.text
    assert as_(team, "carol").delete("/api/data/alice.jsonl").status_code == 403
    for name in ("nothing.jsonl", ".alice.jsonl.meta.json", "alice"):  # absent, its record, no data name
        assert alice.delete(f"/api/data/{name}").status_code == 404, name
    # A job that has not ended names its path: refused (409, naming the job) until it ends.
    job_id, _, _ = plant(team.svc, "alice", state="running", overrides=[f"data.train.path={path}"])
    r = alice.delete("/api/data/alice.jsonl")
    assert r.status_code == 409 and f"named by job {job_id} (running)" in r.json()["problems"][0], r.text
    assert alice.post(f"/api/jobs/{job_id}/cancel").status_code == 200
    r = alice.delete("/api/data/alice.jsonl")
    assert r.status_code == 200 and r.json() == {"deleted": "data file alice.jsonl", "removed": [str(path)], "kept": []}
    assert not path.exists() and not path.with_name(".alice.jsonl.meta.json").exists()
    assert ops.delete("/api/data/bob.jsonl").status_code == 200  # an admin, anyone's
    assert {f["name"] for f in alice.get("/api/data").json()}.isdisjoint({"alice.jsonl", "bob.jsonl"})
    rows = [a for a in audit(team, limit=50) if a[1] == "data.delete"]
    assert rows[-2:] == [("alice", "data.delete", "alice.jsonl (uploaded by alice)"),
                         ("ops", "data.delete", "bob.jsonl (uploaded by bob)")]  # fmt: skip


def test_an_export_is_deleted_by_the_jobs_owner_and_no_longer_offered(team):
    alice = as_(team, "alice")
    job_id, _, run = plant(team.svc, "alice")
    e = outside_folder(team, "e")
    (run / "exports" / "L").symlink_to(e)  # an export folder that is a link out
    assert alice.get(f"/api/jobs/{job_id}/models").json()["exports"] == ["exports/E", "exports/L"]
    assert as_(team, "bob").delete(f"/api/jobs/{job_id}/exports/E").status_code == 403
    for name in ("nothing", ".hidden"):
        assert alice.delete(f"/api/jobs/{job_id}/exports/{name}").status_code == 404, name
    r = alice.delete(f"/api/jobs/{job_id}/exports/E")
    assert r.status_code == 200, r.text
    assert r.json() == {
        "deleted": f"export exports/E of job {job_id}",
        "removed": [str(run / "exports" / "E")],
        "kept": [],
    }
    assert alice.delete(f"/api/jobs/{job_id}/exports/L").status_code == 200
    assert not os.path.lexists(run / "exports" / "L") and (e / "keep.txt").is_file()
    assert not (run / "exports" / "E").exists() and (run / "final" / "model.safetensors").is_file()
    assert alice.get(f"/api/jobs/{job_id}/models").json()["exports"] == []
    (task,) = alice.get(f"/api/jobs/{job_id}/tasks").json()
    assert task["result"] == {"path": "exports/E", "deleted": True}  # the page says so; no archive link
    assert [a[:2] for a in audit(team, job_id=job_id)] == [("alice", "export.delete")] * 2


# -- the checkpoints retention --------------------------------------------------------------------
def age(svc: JobService, job_id: str, run: Path, days: float) -> None:
    """The job ended `days` ago (its record's last change), and its checkpoints were written then."""
    then = time.time() - days * DAY
    with svc.Session() as s:
        s.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(updated=dt.datetime.fromtimestamp(then, dt.UTC).replace(tzinfo=None))
        )
        s.commit()
    for p in (run / "checkpoints").rglob("*"):
        os.utime(p, (then, then), follow_symlinks=False)
    os.utime(run / "checkpoints", (then, then))


def test_the_services_own_sweep_applies_keep_checkpoints_days(team):
    """Through the running service: the admin's PUT, then its periodic sweep (every 0.5 s here)."""
    ops = as_(team, "ops")
    done, _, run = plant(team.svc, "alice")
    stopped, _, kept_run = plant(team.svc, "alice", state="stopped")
    for job_id, folder in ((done, run), (stopped, kept_run)):
        age(team.svc, job_id, folder, 30)
    time.sleep(1.5)  # control: the setting is 0 (kept for ever), the sweep has run
    assert (run / "checkpoints" / "step-1").is_dir()
    try:
        r = ops.put("/api/admin/policy", json={"keep_checkpoints_days": 7})
        assert r.status_code == 200 and r.json()["keep_checkpoints_days"] == 7, r.text
        assert as_(team, "alice").put("/api/admin/policy", json={"keep_checkpoints_days": 1}).status_code == 403
        assert ops.put("/api/admin/policy", json={"keep_checkpoints_days": -1}).status_code == 422
        wait_for(lambda: not (run / "checkpoints" / "step-2").exists(), 20, "the sweep")
    finally:
        assert ops.put("/api/admin/policy", json={"keep_checkpoints_days": 0}).status_code == 200
    assert not (run / "checkpoints" / "step-1").exists() and (run / "final" / "model.safetensors").is_file()
    assert (run / "exports" / "E").is_dir() and (run / "metrics.jsonl").is_file()
    assert not [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".deleting")]
    assert (kept_run / "checkpoints" / "step-1").is_dir()  # a stopped job is meant to resume
    rows = audit(team, job_id=done)
    assert rows == [("retention", "checkpoint.delete", f"checkpoints/step-{n}: the job ended over 7 days ago "
                     "(keep_checkpoints_days)") for n in (1, 2)], rows  # fmt: skip
    with team.svc.Session() as s:  # the page's checkpoint list drops them
        gone = [e.data for e in s.scalars(select(Event).where(Event.job_id == done, Event.kind == "checkpoint"))]
    assert [(d["step"], d.get("removed")) for d in gone] == [(1, None), (2, None), (1, True), (2, True)], gone
    assert audit(team, job_id=stopped) == []


def test_the_retention_sweep_by_a_fake_clock(tmp_path):
    """The real sweep function on real files, its clock moved ahead: what goes, what stays."""
    runs = tmp_path / "runs"
    runs.mkdir()
    svc = JobService(f"sqlite:///{tmp_path / 'serve.db'}", tmp_path / "jobs", "http://127.0.0.1:9",
                     policy=Policy(keep_checkpoints_days=7, write_roots=(str(runs),)))  # fmt: skip
    try:
        jobs = {name: plant(svc, "alice", state=state, **fields) for name, state, fields in (
            ("succeeded", "succeeded", {}), ("failed", "failed", {"exit_code": 1}), ("cancelled", "cancelled", {}),
            ("in-write-root", "succeeded", {"run_dir": runs / "w"}), ("fresh", "succeeded", {}),
            ("stopped", "stopped", {}), ("running", "running", {}), ("queued", "queued", {}),
            ("modal", "succeeded", {"target": "modal"}), ("still-ending", "cancelled", {"target": "slurm", "target_id": "7"}),
            ("busy", "succeeded", {}), ("linked", "succeeded", {}), ("outside", "succeeded", {"run_dir": tmp_path / "elsewhere"}),
        )}  # fmt: skip
        t = time.time()
        with svc.Session() as s:  # a task runs on `busy`: its checkpoints may be read
            s.add(
                TaskRecord(id="t1", job_id=jobs["busy"][0], kind="export", what="x", state="running", started=t, seen=t)
            )
            s.commit()
        target = tmp_path / "target"
        target.mkdir()
        (target / "keep.txt").write_text("not the run's")
        (jobs["linked"][2] / "checkpoints" / "step-3").symlink_to(target)
        fresh = jobs["fresh"][2] / "checkpoints" / "step-2" / "progress.json"
        os.utime(fresh, (t + 29 * DAY, t + 29 * DAY))  # written after the others
        assert retention.sweep(svc, now=t + 6 * DAY) == []  # not 7 days yet
        svc.update_policy({"keep_checkpoints_days": 0})
        assert retention.sweep(svc, now=t + 300 * DAY) == []  # 0: kept for ever
        svc.update_policy({"keep_checkpoints_days": 7})
        removed = retention.sweep(svc, now=t + 30 * DAY)
        ck = lambda name, n: str(jobs[name][2] / "checkpoints" / f"step-{n}")  # noqa: E731
        want = {ck(name, n) for name in ("succeeded", "failed", "cancelled", "in-write-root", "linked") for n in (1, 2)}
        assert set(removed) == want | {ck("fresh", 1), ck("linked", 3)}, sorted(set(removed) ^ want)
        for name, (_, _, run) in jobs.items():
            assert (run / "final" / "model.safetensors").is_file() and (run / "exports" / "E").is_dir(), name
            left = sorted(p.name for p in (run / "checkpoints").iterdir())
            if name in ("succeeded", "failed", "cancelled", "in-write-root", "linked"):
                assert left == ["latest"], (name, left)
            elif name == "fresh":
                assert left == ["latest", "step-2"], left
            else:
                assert left == ["latest", "step-1", "step-2"], (name, left)
        assert (target / "keep.txt").is_file()  # the link went, not what it named
        assert retention.sweep(svc, now=t + 30 * DAY) == []  # nothing twice
        with svc.Session() as s:
            rows = s.execute(text("SELECT actor, action, job_id FROM audit")).all()
        job_of = {str(run): job_id for job_id, _, run in jobs.values()}
        assert sorted(map(tuple, rows)) == sorted(
            ("retention", "checkpoint.delete", job_of[str(Path(p).parent.parent)]) for p in removed
        )
    finally:
        svc.engine.dispose()


# -- the page --------------------------------------------------------------------------------------
def test_delete_buttons_on_the_page_ask_first(server, page):
    """Chromium, logged in with the submit token: an export's Delete (No keeps it, Yes deletes it),
    the job's Delete (then the job list, without it), a data file's Delete."""
    from selenium.webdriver.common.by import By

    api = client(server, server.submit)
    me = identify(server.svc.Session, server.submit)[0]
    job_id, job_dir, run = plant(server.svc, me)
    name = f"page-{job_id}.jsonl"
    assert api.post("/api/data", params={"name": name}, content=RECORD).status_code == 201
    page.get(f"{server.url}/jobs/{job_id}")
    click = lambda css: page.find_element(By.CSS_SELECTOR, css).click()  # noqa: E731
    wait_for(lambda: dom(page, "#downloads .export-delete"), 20, "the export's Delete")
    click("#downloads .export-delete")
    assert dom(page, "#downloads .confirm", visible=True) and page.switch_to.active_element.text == "No, keep it"
    click("#downloads .export-delete-no")
    assert not dom(page, "#downloads .confirm") and (run / "exports" / "E").is_dir()
    click("#downloads .export-delete")
    click("#downloads .export-delete-yes")
    wait_for(
        lambda: "exports/E" not in dom(page, "#downloads a.archive", "data-path"), 20, "the export gone from the page"
    )
    assert not (run / "exports" / "E").exists()
    wait_for(lambda: any("exports/E (deleted)" in t for t in dom(page, "#tasks li")), 20, "the task saying so")
    assert not dom(page, "#delete-confirm", visible=True) and dom(page, "#delete", visible=True)
    click("#delete")
    assert dom(page, "#delete-confirm", visible=True) and dom(page, "#delete", "aria-expanded") == ["true"]
    click("#delete-yes")
    wait_for(lambda: page.current_url == server.url + "/", 20, "the job list")
    wait_for(lambda: dom(page, "#deleted-note", visible=True) == [f"job {job_id} was deleted"], 20, "the note")
    assert job_id not in dom(page, "#jobs tbody tr", "data-job") and not job_dir.exists()
    assert api.get(f"/api/jobs/{job_id}").status_code == 404
    row = f'#data-files li[data-name="{name}"]'
    wait_for(lambda: dom(page, row), 20, "the data file's row")
    click(f"{row} .data-delete")
    click(f"{row} .data-delete-yes")
    wait_for(lambda: not dom(page, row), 20, "the data file's row gone")
    assert name not in {f["name"] for f in api.get("/api/data").json()}
