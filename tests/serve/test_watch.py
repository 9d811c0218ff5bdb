"""The watcher through the real service (issue 22, items 1 and 5): many jobs submitted at once
under a concurrency limit of 2, none ever lost, never more than 2 processes at once, each settled
by its exit code; a job settled lost whose process lives or later exits is re-settled; the phase
after a checkpoint and after a cancel.

The runs are a stand-in for `python -m scaletune train` (a tiny train job takes about 45 s on 2
busy cores): a real child of the real dispatcher and wrapper that reports what the trainer reports,
in the trainer's words (`report.event_line`, posted with `report.Reporter` and printed to its log),
and writes `final/`. tests/serve/test_load.py runs 20 real training jobs the same way (slow tier)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from scaletune.serve.jobs.db import Job
from tests.helpers import make_config
from tests.serve.serve_helpers import Server, client, read_events, wait_state

JOBS, LIMIT = 12, 2
TERMINAL = {"succeeded", "failed", "cancelled", "stopped"}

# What Trainer.run reports, in its order: phases, steps (metrics.jsonl), a checkpoint after steps
# 1 and 2 (`save`), the export. Each interval of its life goes into LIFE (a file of its own per
# process: start and end times), the control of how many ran at once.
_STUB = """#!{python}
import json, os, sys, time
from pathlib import Path
from scaletune.report import Reporter, event_line

run_dir = Path(json.loads(sys.argv[-1].split("=", 1)[1]))  # the service's last override: output_dir=
hold = {hold}
life = Path({life!r}) / f"{{os.getpid()}}"
life.write_text(f"{{time.time()}}\\n")
reporter = Reporter()

def report(kind, **data):
    print(event_line(kind, data), flush=True)
    reporter.add(kind, data, flush=True)

report("phase", phase="loading data")
report("phase", phase="loading model")
run_dir.mkdir(parents=True, exist_ok=True)
report("phase", phase="training", stage="main")
for step in (1, 2):
    time.sleep(hold)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({{"step": step, "loss": 1.0 / step, "stage": "main"}}) + "\\n")
    report("phase", phase="checkpointing", step=step)
    (run_dir / "checkpoints" / f"step-{{step}}").mkdir(parents=True)
    report("saved checkpoint", step=step, path=str(run_dir / "checkpoints" / f"step-{{step}}"))
time.sleep(hold)
report("phase", phase="exporting")
(run_dir / "final").mkdir()
with open(life, "a") as f:
    f.write(f"{{time.time()}}\\n")
"""


def stub(root: Path, hold: float) -> str:
    life = root / "life"
    life.mkdir(parents=True, exist_ok=True)
    path = root / f"stub-{hold}"
    path.write_text(_STUB.format(python=sys.executable, hold=hold, life=str(life)))
    path.chmod(0o755)
    return str(path)


def peak_overlap(life: Path) -> int:
    """The most processes alive at one time, from the start and end each wrote."""
    edges = []
    for f in life.iterdir():
        start, end = (float(x) for x in f.read_text().split())
        edges += [(start, 1), (end, -1)]
    peak = now = 0
    for _, d in sorted(edges, key=lambda e: (e[0], e[1])):  # an end before a start at the same time
        now += d
        peak = max(peak, now)
    return peak


@pytest.fixture(scope="module")
def srv(module_tmp_path):
    server = Server(f"sqlite:///{module_tmp_path / 'db.sqlite'}", module_tmp_path / "jobs", max_concurrent=LIMIT)
    yield server
    server.cancel_all()
    server.stop()


def config(model: Path, out: Path) -> str:
    return yaml.safe_dump(make_config(model, out, training={"max_steps": 2, "save_every": 1}))


def test_many_jobs_at_once_none_lost_never_over_the_limit(srv, tiny_model_dir, tmp_path):
    """12 jobs posted at once under `--max-concurrent 2`. Before, a job polled right after its
    start was often settled `failed (lost)` (its command line not readable yet), kept running,
    and its freed slot let a third job start."""
    srv.svc.dispatchers["local"].python = stub(tmp_path, hold=0.4)
    c = client(srv, None)
    ids: list[str] = []
    errors: list[str] = []

    def post(i: int) -> None:
        r = client(srv, None).post("/api/jobs", json={"config": config(tiny_model_dir, tmp_path / f"run-{i}")})
        (ids.append(r.json()["id"]) if r.status_code == 201 else errors.append(r.text))

    posters = [threading.Thread(target=post, args=(i,)) for i in range(JOBS)]
    for t in posters:
        t.start()
    for t in posters:
        t.join()
    assert not errors and len(ids) == JOBS, errors

    # Sampled while they run: the records' count of running jobs, and no job ever failed.
    active, failed = [], []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        jobs = [j for j in c.get("/api/jobs").json() if j["id"] in ids]
        active.append(sum(j["state"] in ("starting", "running", "stopping") for j in jobs))
        failed += [j for j in jobs if j["state"] == "failed"]
        if all(j["state"] in TERMINAL for j in jobs):
            break
        time.sleep(0.1)
    assert not failed, failed[:2]
    assert max(active) == LIMIT, active  # the limit reached, never passed
    assert peak_overlap(tmp_path / "life") == LIMIT  # the processes themselves
    for job_id in ids:
        job = c.get(f"/api/jobs/{job_id}").json()
        assert (job["state"], job["exit_code"], job["reason"], job["phase"]) == ("succeeded", 0, None, None), job
        assert job["step"] == 2


def test_phase_returns_to_training_after_a_checkpoint(srv, tiny_model_dir, tmp_path):
    """The trainer reports `checkpointing` when a save starts and the saved checkpoint when it
    ends; the run trains on. Before, the phase stayed `checkpointing` until the export."""
    srv.svc.dispatchers["local"].python = stub(tmp_path, hold=2.0)
    c = client(srv, None)
    job_id = c.post("/api/jobs", json={"config": config(tiny_model_dir, tmp_path / "run")}).json()["id"]
    events = read_events(c, job_id, lambda k, d: k == "checkpoint" and d["step"] == 1, timeout=60)
    assert any(k == "state" and d.get("phase") == "checkpointing" for _, k, d in events)  # it was checkpointing
    time.sleep(3 * srv.svc.watcher.poll_s)  # the log's copy of the lines read too
    job = c.get(f"/api/jobs/{job_id}").json()
    assert (job["state"], job["phase"], job["step"]) == ("running", "training", 1), job
    job = wait_state(c, job_id, TERMINAL, timeout=60)
    assert (job["state"], job["phase"]) == ("succeeded", None), job
    phases = [
        d["phase"] for _, k, d in read_events(c, job_id, lambda k, d: d.get("state") == "succeeded") if "phase" in d
    ]
    after = phases[phases.index("checkpointing") :]
    assert after[:2] == ["checkpointing", "training"] and after[-2:] == ["exporting", None], phases


def test_a_cancelled_job_has_no_phase(srv, tiny_model_dir, tmp_path):
    srv.svc.dispatchers["local"].python = stub(tmp_path, hold=30.0)
    c = client(srv, None)
    job_id = c.post("/api/jobs", json={"config": config(tiny_model_dir, tmp_path / "run")}).json()["id"]
    read_events(c, job_id, lambda k, d: k == "state" and d.get("phase") == "training", timeout=60)
    assert c.get(f"/api/jobs/{job_id}").json()["phase"] == "training"  # the control
    assert c.post(f"/api/jobs/{job_id}/cancel").json()["state"] == "cancelled"
    deadline = time.monotonic() + 30
    while (job := c.get(f"/api/jobs/{job_id}").json())["exit_code"] is None and time.monotonic() < deadline:
        time.sleep(0.2)  # polled until its process is seen ended; its log read meanwhile
    assert (job["state"], job["phase"]) == ("cancelled", None), job
    last = [d for _, k, d in read_events(c, job_id, lambda k, d: d.get("state") == "cancelled") if k == "state"][-1]
    assert last == {"state": "cancelled", "phase": None}, last  # what the page is told


def test_a_job_settled_lost_while_its_process_lives_is_re_settled(srv, tiny_model_dir, tmp_path):
    """A job recorded `failed (lost)` (as the old check did, or a restart that could not see its
    process) is asked about again: running while its process lives, then settled by its exit code."""
    srv.svc.dispatchers["local"].python = stub(tmp_path, hold=2.0)
    c = client(srv, None)
    job_id = c.post("/api/jobs", json={"config": config(tiny_model_dir, tmp_path / "run")}).json()["id"]
    wait_state(c, job_id, {"running"}, timeout=60)
    with srv.svc.lock, srv.svc.Session() as s:
        job = s.get(Job, job_id)
        job.state, job.reason = "failed", "lost"
        s.commit()
    job = wait_state(c, job_id, {"running", "succeeded"}, timeout=30)
    job = wait_state(c, job_id, TERMINAL, timeout=60)
    assert (job["state"], job["exit_code"], job["reason"]) == ("succeeded", 0, None), job
    lines = [d["line"] for _, k, d in read_events(c, job_id, lambda k, d: d.get("state") == "succeeded") if k == "log"]
    assert any("not lost" in ln for ln in lines), lines


def test_a_real_run_trains_on_after_its_checkpoint(srv, tiny_model_dir, tmp_path):
    """The stand-in's proof with the real trainer (`scaletune train`, 4 steps, a checkpoint at 2
    and at the end): the phase after the step-2 checkpoint is training again; none once it ended."""
    srv.svc.dispatchers["local"].python = sys.executable
    c = client(srv, None)
    cfg = make_config(
        tiny_model_dir, tmp_path / "run", training={"max_steps": 4, "save_every": 2, "micro_batch_size": 8}
    )
    job_id = c.post("/api/jobs", json={"config": yaml.safe_dump(cfg)}).json()["id"]
    events = read_events(c, job_id, lambda k, d: k == "state" and d["state"] in TERMINAL, timeout=600)
    assert events[-1][2]["state"] == "succeeded", events[-5:]
    kinds = [(k, d.get("step") if k == "checkpoint" else d.get("phase")) for _, k, d in events if k != "log"]
    kinds = [(k, v) for k, v in kinds if k in ("checkpoint", "state")]
    at = kinds.index(("checkpoint", 2))
    assert kinds[at - 1] == ("state", "checkpointing") and kinds[at + 1] == ("state", "training"), kinds
    assert c.get(f"/api/jobs/{job_id}").json()["phase"] is None
