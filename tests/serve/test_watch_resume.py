"""What the watcher reads and offers across a job's life (issue 22, items 2 and 5), through the real
service, dispatcher and wrapper: a job's log events are its log's lines once each after a service
restart and a stop + resume (before, a resume read the appended log from its start again: 172
events for 90 lines after two resumes); the checkpoints offered are those in the run directory
(before, the ones `keep_last` removed were still offered).

The run is a stand-in for `python -m scaletune train`, as in test_watch.py: a real child that
prints scaletune's own lines, stops at the stop request as the trainer does (exit 0), counts on
where the last run of its job stopped (as a resume does), and saves and prunes `checkpoints/step-N`
the way `checkpoint.save` does (the newest `keep_last` kept)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from scaletune.serve.jobs.dispatch.base import LOG_FILE
from tests.helpers import make_config, wait_for
from tests.serve.serve_helpers import Server, client, dom, read_events, wait_state

TERMINAL = {"succeeded", "failed", "cancelled", "stopped"}

_STUB = """#!{python}
import json, os, shutil, sys, time
from pathlib import Path
from scaletune.report import STOP_ENV, Reporter, event_line

run_dir = Path(json.loads(sys.argv[-1].split("=", 1)[1]))  # the service's last override: output_dir=
run_dir.mkdir(parents=True, exist_ok=True)
counter = run_dir / "lines"  # the lines this job's runs printed: a resumed run goes on after them
n = int(counter.read_text()) if counter.exists() else 0
stop = Path(os.environ[STOP_ENV])
reporter = Reporter()

def save(step):
    root = run_dir / "checkpoints"
    path = root / f"step-{{step}}"
    path.mkdir(parents=True, exist_ok=True)
    data = {{"step": step, "path": str(path)}}
    print(event_line("checkpoint", data), flush=True)
    reporter.add("checkpoint", data, flush=True)
    done = sorted(root.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    for old in done[:-{keep}]:  # checkpoint.save._prune
        if old != path:
            shutil.rmtree(old)

while n < {lines}:
    n += 1
    print(f"scaletune: line {{n}}", flush=True)
    counter.write_text(str(n))
    if {every} and n % {every} == 0:
        save(n // {every})
    if stop.exists():
        sys.exit(0)  # stopped on request, as the trainer stops
    time.sleep({hold})
(run_dir / "final").mkdir()
"""


def stub(root: Path, *, lines: int, hold: float, every: int = 0, keep: int = 1) -> str:
    path = root / "stub"
    path.write_text(_STUB.format(python=sys.executable, lines=lines, hold=hold, every=every, keep=keep))
    path.chmod(0o755)
    return str(path)


@pytest.fixture(scope="module")
def srv(module_tmp_path):
    server = Server(f"sqlite:///{module_tmp_path / 'db.sqlite'}", module_tmp_path / "jobs", max_concurrent=2)
    yield server
    server.cancel_all()
    server.stop()


def config(model: Path, out: Path) -> str:
    return yaml.safe_dump(make_config(model, out, training={"max_steps": 2}))


def own_lines(c, job_id: str, until) -> list[str]:
    return [
        d["line"]
        for _, k, d in read_events(c, job_id, until, timeout=60)
        if k == "log" and d["line"].startswith("scaletune: line")
    ]


def test_log_events_once_each_across_a_restart_and_a_resume(srv, tiny_model_dir, tmp_path):
    lines = 60
    srv.svc.dispatchers["local"].python = stub(tmp_path, lines=lines, hold=0.1)
    c = client(srv, None)
    job_id = c.post("/api/jobs", json={"config": config(tiny_model_dir, tmp_path / "run")}).json()["id"]
    own_lines(c, job_id, lambda k, d: k == "log" and d["line"] == "scaletune: line 3")

    srv.restart()  # (a) the same database, a new service: the job re-attached and read on
    srv.svc.dispatchers["local"].python = stub(tmp_path, lines=lines, hold=0.1)
    c = client(srv, None)
    own_lines(c, job_id, lambda k, d: k == "log" and d["line"] == "scaletune: line 12")
    assert c.post(f"/api/jobs/{job_id}/stop").status_code == 200
    job = wait_state(c, job_id, TERMINAL, timeout=60)
    assert job["state"] == "stopped", job
    stopped_at = int((tmp_path / "run" / "lines").read_text())
    assert 12 <= stopped_at < lines  # the control: the resume has lines left to print

    r = c.post(f"/api/jobs/{job_id}/resume", json={})  # (b) its log appended to by the new run
    assert r.status_code == 200, r.text
    job = wait_state(c, job_id, TERMINAL, timeout=60)
    assert job["state"] == "succeeded", job

    log = (srv.svc.home / job_id / LOG_FILE).read_text().splitlines()
    printed = [ln for ln in log if ln.startswith("scaletune: line")]
    assert printed == [f"scaletune: line {i}" for i in range(1, lines + 1)]  # the log: each line once
    events = own_lines(c, job_id, lambda k, d: k == "state" and d["state"] == "succeeded")
    assert len(events) == len(printed) and events == printed, (len(events), len(printed))


def offered(events: list) -> set[str]:
    """The checkpoints the stream offers at its end: each path's last event, unless a removal."""
    last = {d["path"]: d for _, k, d in events if k == "checkpoint"}
    return {Path(p).name for p, d in last.items() if not d.get("removed")}


def test_checkpoints_offered_are_those_in_the_run_directory(srv, tiny_model_dir, tmp_path):
    """keep_last 1, a checkpoint every 3 lines: 4 saved, each removed when the next is saved."""
    srv.svc.dispatchers["local"].python = stub(tmp_path, lines=12, hold=0.5, every=3, keep=1)
    c = client(srv, None)
    run = tmp_path / "run"
    job_id = c.post("/api/jobs", json={"config": config(tiny_model_dir, run)}).json()["id"]
    # While it runs: step-1 is dropped once step-2 replaced it, and final/ does not exist yet.
    events = read_events(c, job_id, lambda k, d: k == "checkpoint" and d["step"] == 1 and d.get("removed"), timeout=30)
    assert c.get(f"/api/jobs/{job_id}").json()["state"] not in TERMINAL  # (no phase reported: `starting`)
    assert "step-1" not in offered(events) and not (run / "checkpoints" / "step-1").exists()
    if not (run / "final").exists():  # (read first: on a slow machine the run may have ended)
        assert c.get(f"/api/jobs/{job_id}/artifacts/final").status_code == 404  # so the page links none

    job = wait_state(c, job_id, TERMINAL, timeout=60)
    assert job["state"] == "succeeded", job
    events = read_events(c, job_id, lambda k, d: k == "state" and d["state"] == "succeeded")
    saved = sorted({d["step"] for _, k, d in events if k == "checkpoint"})
    assert saved == [1, 2, 3, 4]  # the control: every save was reported
    listing = {p.name for p in (run / "checkpoints").glob("step-*")}
    assert listing == {"step-4"} and offered(events) == listing, (offered(events), listing)
    # What a checkpoint links to exists: its own files (the page's link), and final/ once written.
    files = c.get(f"/api/jobs/{job_id}/artifacts/checkpoints/step-4")
    assert files.status_code == 200
    assert c.get(f"/api/jobs/{job_id}/artifacts/final").status_code == 200
    assert c.get(f"/api/jobs/{job_id}/artifacts/checkpoints/step-1").status_code == 404


def test_the_page_lists_the_checkpoints_that_exist(server, page, tiny_model_dir, tmp_path):  # noqa: F811
    """The same run on the job page in Chromium: the list follows the folder, each entry links to
    the checkpoint's own files, and final/ is linked only once it exists."""

    server.svc.dispatchers["local"].python = stub(tmp_path, lines=12, hold=0.5, every=3, keep=1)
    c = client(server, server.submit)
    run = tmp_path / "run"
    job_id = c.post("/api/jobs", json={"config": config(tiny_model_dir, run)}).json()["id"]
    page.get(f"{server.url}/jobs/{job_id}")

    def shown() -> list[str]:
        return [Path(path).name for path in dom(page, "#checkpoints li", "data-path")]

    # While it runs (step-2 or step-3 the newest), the folder's one checkpoint, and no final/ link.
    wait_for(lambda: shown() in (["step-2"], ["step-3"]), 30, "step-1 dropped from the page")
    assert not (run / "final").exists()  # read first: the page cannot have seen it either
    assert not dom(page, "#final", visible=True)
    assert wait_state(c, job_id, TERMINAL, timeout=60)["state"] == "succeeded"
    wait_for(lambda: shown() == ["step-4"], 15, "the page's list at the end")
    assert {p.name for p in (run / "checkpoints").glob("step-*")} == {"step-4"}
    wait_for(lambda: dom(page, "#final", visible=True), 15, "the final/ link")
    links = dom(page, "#checkpoints a", prop="href")
    assert links == [f"{server.url}/api/jobs/{job_id}/artifacts/checkpoints/step-4"], links
    assert c.get(links[0]).status_code == 200
