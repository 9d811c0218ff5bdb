"""What the system tier's tests share: the small config every run trains and the check that a run
trains like the single-process reference, the all-reduce payload, and bounded subprocesses. The
fixtures (the reference run, the SLURM cluster) are in tests/system/conftest.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from scaletune.serve.jobs.dispatch.local import descendants
from tests.helpers import make_config, subprocess_env

PAYLOAD = Path(__file__).resolve().parent / "payload_allreduce.py"
MAX_STEPS = 8


def start(
    argv: list[str], *, cwd: Path | None = None, env: dict | None = None, log: Path | None = None
) -> subprocess.Popen:
    """A subprocess in its own session (so :func:`stop` ends it and all its children)."""
    out = open(log, "w") if log else subprocess.PIPE
    return subprocess.Popen(
        [str(a) for a in argv],
        cwd=cwd,
        env=env or subprocess_env(),
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen) -> None:
    """Kill `proc`, its process group and every descendant; no-op once all have exited."""
    tree = descendants(proc.pid)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.wait(timeout=30)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for every process; on timeout kill them all and fail."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            left = deadline - time.monotonic()
            p.wait(timeout=max(left, 0.1))
    except subprocess.TimeoutExpired:
        for p in procs:
            stop(p)
        pytest.fail(f"processes did not finish within {timeout} s")
    return [p.returncode for p in procs]


def system_config(model_dir: Path, out: Path | str) -> dict[str, Any]:
    """The small fp32 config of the system tests: 64 real Alpaca records, seq 64, 8 sequences per
    optimizer step (micro batch 2: accumulation 4 on one rank, 2 on two), MAX_STEPS steps without
    warmup (so every step but the first follows an update at the full learning rate), a
    checkpoint at step 4. `strategy: auto` so the same file runs on one rank and under a launcher."""
    return make_config(
        model_dir, out, training={"max_steps": MAX_STEPS, "warmup_steps": 0}, distributed={"strategy": "auto"}
    )


def assert_trains_like_reference(run_dir: Path, ref_dir: Path, rel: float = 1e-4) -> None:
    """The run logs every step 1..MAX_STEPS with the single-process reference's loss and gradient
    norm (within `rel`, relative), and its final/ model computes the reference's logits."""
    from tests.helpers import assert_same_logits, assert_same_steps, logits, steps

    assert [m["step"] for m in steps(run_dir)] == list(range(1, MAX_STEPS + 1)), steps(run_dir)
    assert_same_steps(run_dir, ref_dir, rel, f"{run_dir} vs the single-process run")
    assert_same_logits(logits(run_dir / "final"), logits(ref_dir / "final"), f"{run_dir}/final")
