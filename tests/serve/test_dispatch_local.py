"""The local dispatcher's process tree: what `cancel` ends is every process below the job's,
including those that left its session (torchrun's workers); and how it knows a job's process:
by PID and start time, never `lost` while the process lives."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from scaletune.serve.jobs.dispatch.base import JobFiles, Status, start_mark
from scaletune.serve.jobs.dispatch.local import LocalDispatcher, _exists, descendants


def test_descendants_finds_a_grandchild_in_another_session():
    # sh -> setsid sh -> sleep; the inner shell prints the sleep's PID (the control).
    inner = "sleep 30 & echo $!; wait"
    proc = subprocess.Popen(["sh", "-c", f"setsid sh -c '{inner}'"], stdout=subprocess.PIPE, text=True)
    try:
        sleeper = int(proc.stdout.readline())
        tree = descendants(proc.pid)
        assert sleeper in tree and proc.pid not in tree, tree
        assert _exists(sleeper)
    finally:
        for pid in descendants(proc.pid):
            subprocess.run(["kill", str(pid)], check=False)
        proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _exists(sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _exists(sleeper)
    assert descendants(proc.pid) == []  # gone (reaped): no tree, no error


# -- knowing a job's process: never `lost` while it lives (issue 22, item 1) ---------------------


def _stub(tmp_path: Path, body: str) -> str:
    """A program standing in for the python that runs `-m scaletune train CONFIG ...`: the real
    dispatcher, wrapper and process table, without a model."""
    stub = tmp_path / "stub"
    stub.write_text(f"#!/bin/sh\n{body}\n")
    stub.chmod(0o755)
    return str(stub)


def _job(root: Path, i: int) -> JobFiles:
    job_dir = root / f"job-{i}"
    job_dir.mkdir()
    return JobFiles(f"job-{i}", job_dir, job_dir / "config.yaml", (), {}, root)


def test_forty_processes_polled_at_once_are_running_never_lost(tmp_path):
    """Each of 40 jobs polled right after its start, by the dispatcher that started it and by a
    second one (a restarted service: no child handle, only the job folder and the process table),
    then once they ended. The old check read /proc/PID/cmdline, empty or the service's own until
    the exec completes, and answered `lost` for about a quarter of them (11 of 40 here)."""
    d = LocalDispatcher(max_concurrent=None, python=_stub(tmp_path, "sleep 2; exit 3"))
    other = LocalDispatcher(max_concurrent=None)
    jobs, seen = [], []
    for i in range(40):
        job = _job(tmp_path, i)
        pid = d.submit(job)
        seen.append((d.poll(pid, job).state, other.poll(pid, job).state))
        jobs.append((pid, job))
    assert seen == [("running", "running")] * 40, [s for s in seen if s != ("running", "running")]
    # The control: the process table. None starts meanwhile, so the count lies between the two.
    before = sum(_exists(int(p)) for p, _ in jobs)
    counted = d.running()
    assert before >= counted >= sum(_exists(int(p)) for p, _ in jobs), (before, counted)
    deadline = time.monotonic() + 30
    while d.running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert d.running() == 0
    for pid, job in jobs:  # each ended with the stub's code, as its wrapper wrote it
        assert d.poll(pid, job) == other.poll(pid, job) == Status("exited", 3)
        assert (job.job_dir / "exit-code").read_text().strip() == "3"


def test_a_reused_pid_is_not_the_job_and_the_job_is_lost_after_the_grace(tmp_path):
    """The recorded start mark tells the job's process from another one given its PID later: a
    process with the PID but another start is not the job. `lost` comes only after the grace, in
    which a late exit code would still settle it."""
    d = LocalDispatcher(max_concurrent=None, python=_stub(tmp_path, "sleep 30"))
    job = _job(tmp_path, 0)
    pid = d.submit(job)
    try:
        pid_, mark = (job.job_dir / "process").read_text().split()
        assert pid_ == pid and mark == start_mark(int(pid)) and mark is not None
        # The control: the record as written names the live process.
        restarted = LocalDispatcher(max_concurrent=None, lost_grace_s=0.5)
        assert restarted.poll(pid, job) == Status("running")
        (job.job_dir / "process").write_text(f"{pid} t1\n")  # as if the PID were another process's now
        restarted = LocalDispatcher(max_concurrent=None, lost_grace_s=0.5)
        assert restarted.poll(pid, job) == Status("ending")
        time.sleep(0.6)
        assert restarted.poll(pid, job) == Status("lost")
    finally:
        d.cancel(pid, job)
    assert d.running() == 0


def test_a_late_exit_code_in_the_grace_settles_the_job_by_it(tmp_path):
    d = LocalDispatcher(max_concurrent=None, python=_stub(tmp_path, "exit 0"))
    job = _job(tmp_path, 0)
    pid = d.submit(job)
    deadline = time.monotonic() + 10
    while d.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    code = job.job_dir / "exit-code"
    code.unlink()  # not visible yet (a slow file system): gone, its end unknown
    restarted = LocalDispatcher(max_concurrent=None, lost_grace_s=30)
    assert restarted.poll(pid, job) == Status("ending")
    code.write_text("0\n")
    assert restarted.poll(pid, job) == Status("exited", 0)
