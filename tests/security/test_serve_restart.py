"""The restart window (issue 21, item 6): a service killed right after it started a job's process,
before it recorded it, must not start the job twice after a restart (the new service adopts the
orphan); services started at once on a fresh database all come up (the migration takes turns)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import httpx
import psutil
import yaml

from tests.helpers import make_config
from tests.serve.serve_helpers import REPO_ROOT, TEST_POLICY, Server, free_port, wait_state

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)])}

# The real service in a process of its own, which dies (os._exit: no clean-up, as a SIGKILL)
# the moment its dispatcher has started a job's process, before anything is recorded.
_DIES_AFTER_START = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import uvicorn
    from scaletune.serve.app import create_app
    from scaletune.serve.jobs.dispatch import local
    from scaletune.serve.jobs.service import JobService
    from tests.serve.serve_helpers import TEST_POLICY

    start = local.LocalDispatcher.submit

    def submit(self, job):
        start(self, job)
        os._exit(9)

    local.LocalDispatcher.submit = submit
    db, home, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    svc = JobService(db, home, f"http://127.0.0.1:{port}", policy=TEST_POLICY)
    uvicorn.run(create_app(svc), host="127.0.0.1", port=port, log_level="warning")
    """
)


def _wrappers(job_dir) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if cmd[:2] == ["/bin/sh", "-c"] and any(str(job_dir) in a for a in cmd[3:4]) and p.status() != "zombie":
            out.append(p.pid)
    return out


def _wait_up(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the service exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}"
        assert time.monotonic() < deadline, "the service did not come up"
        try:
            httpx.get(url + "/api/jobs", timeout=2)
            return
        except httpx.TransportError:
            time.sleep(0.3)


def test_killed_between_start_and_record_adopts_the_orphan(tiny_model_dir, tmp_path):
    db, home, port = f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs", free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", _DIES_AFTER_START, db, str(home), str(port)],
        env=ENV,
        cwd=REPO_ROOT,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    _wait_up(url, proc)
    cfg = make_config(tiny_model_dir, tmp_path / "run")
    cfg["training"].update(max_steps=30, save_every=0, micro_batch_size=8)
    try:
        httpx.post(url + "/api/jobs", json={"config": yaml.safe_dump(cfg)}, timeout=120)
    except httpx.TransportError:
        pass  # the service died while answering
    assert proc.wait(timeout=60) == 9
    job_dir = next(home.iterdir())
    deadline = time.monotonic() + 10
    while not (orphans := _wrappers(job_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(orphans) == 1, orphans
    srv = Server(db, home, policy=TEST_POLICY)  # the restart
    try:
        c = httpx.Client(base_url=srv.url, timeout=60)
        for _ in range(20):
            assert len(_wrappers(job_dir)) <= 1, "the job was started a second time"
            time.sleep(0.25)
        job = wait_state(c, job_dir.name, {"succeeded", "failed", "cancelled", "stopped"}, timeout=300)
        assert job["state"] == "succeeded" and job["target_id"] == str(orphans[0]), job
        steps = [m["step"] for m in c.get(f"/api/jobs/{job_dir.name}/metrics").json()]
        assert steps == list(range(1, 31)), steps
    finally:
        srv.cancel_all()
        srv.stop()


def test_services_started_at_once_on_a_fresh_database(tmp_path):
    """Four services open one fresh SQLite database at the same instant (a barrier on the clock);
    every one migrates or finds it migrated, none dies."""
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    at = time.time() + 12  # the imports done by then, on a busy machine too
    code = (
        "import sys, time\nfrom scaletune.serve.jobs.db import open_db\n"
        "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\nopen_db(sys.argv[1])\nprint('opened')\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, db, str(at)],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    for code_, out, err in results:
        assert code_ == 0 and "opened" in out, err[-2000:]
