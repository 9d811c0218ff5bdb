"""Fixtures of the system tier: a one-node SLURM cluster on this machine and the single-process
reference run the distributed runs are compared with. What the tests import (the config, bounded
subprocesses) is in tests/system/system_helpers.py, never here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.helpers import subprocess_env
from tests.system.system_helpers import system_config

CLUSTER_SCRIPT = Path(__file__).resolve().parent / "slurm_cluster.sh"


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
