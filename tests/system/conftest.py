"""Fixtures of the system tier: a one-node SLURM cluster on this machine, the single-process
reference run the distributed runs are compared with, and bounded subprocesses."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from scaletune.serve.dispatch.local import descendants  # noqa: F401 - the tests import it from here
from tests.helpers import make_config, subprocess_env

HERE = Path(__file__).resolve().parent
PAYLOAD = HERE / "payload_allreduce.py"
CLUSTER_SCRIPT = HERE / "slurm_cluster.sh"
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


@pytest.fixture(scope="package")
def reference_run(tiny_model_dir, tmp_path_factory) -> Iterator[Path]:
    """The run directory of the single-process run of :func:`system_config`."""
    d = tmp_path_factory.mktemp("reference")
    cfg_path = d / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(system_config(tiny_model_dir, d / "run")))
    proc = subprocess.run(
        [sys.executable, "-m", "scaletune", "train", str(cfg_path)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=d,
        timeout=300,
    )
    if proc.returncode != 0:
        pytest.fail(f"single-process reference run failed:\n{proc.stderr[-4000:]}")
    yield d / "run"
    shutil.rmtree(d, ignore_errors=True)


def skip_unless_ci(reason: str) -> None:
    """Skip, saying why; under CI=true fail instead (CI must run the SLURM tests, not skip them)."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and SLURM cannot start: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A one-node SLURM cluster (munged, slurmctld, slurmd as root) for the session; yields the
    environment to reach it (SLURM_CONF). Skips only where SLURM cannot start, saying why, and
    fails there instead under CI=true."""
    d = tmp_path_factory.mktemp("slurm")
    if " " in str(d):  # slurm.conf paths cannot hold spaces
        skip_unless_ci(f"the pytest temporary directory has a space ({d}); slurm.conf cannot point into it")
    try:
        r = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start", str(d)], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop", str(d)], timeout=60)
        pytest.fail("starting the SLURM cluster took more than 10 minutes")
    if r.returncode == 3:
        skip_unless_ci(r.stderr.strip().splitlines()[-1])
    if r.returncode != 0:
        pytest.fail(f"slurm_cluster.sh start failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    env = subprocess_env(SLURM_CONF=str(d / "slurm.conf"))
    try:
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=30)
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop", str(d)], capture_output=True, timeout=120)
