"""The suite's delegated processes (tests/forked_cli.py delegate: a torchrun or a rank that hands
itself to the test worker's zygote, so that a fork which has imported torch becomes it) are what a
fresh process would be, for what a program can see of how it started and for how it ends.

The control is the same torchrun with SCALETUNE_TEST_FORK=0, whose agent and ranks start as users'
do. Each rank of tests/distributed/delegation_probe.py reports its argv, `sys.path[0]`, working
directory, `__main__`, umask, session, launcher variables, standard streams' buffering and signal
dispositions: the delegated ranks' reports equal the fresh ones' but for the one thing that tells
them apart (torch already imported). Then the ways a run ends: a rank's exit status and a rank's
death by SIGKILL reach torchrun as they do from a fresh rank (`exitcode: 3`, `exitcode: -9`), and
torchrun's SIGTERM to the surviving rank's process group ends it (else the run would hang).

A process started as the service starts a job's (its own HF_HOME, PYTHONSAFEPATH, PYTHONUNBUFFERED:
scaletune/serve/jobs/dispatch/base.py job_environment) is handed over too: its fork re-points what
huggingface_hub, transformers, datasets and accelerate read below the Hugging Face home at import
(tests/forked_cli.py rehome), and every such binding, sys.path and its output's buffering equal a
fresh process's that imported the same modules."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.forked_cli import hf_home
from tests.helpers import REPO_ROOT, SESSION_ENVIRON, run_python, run_torchrun

pytestmark = pytest.mark.distributed

PROBE = REPO_ROOT / "tests" / "distributed" / "delegation_probe.py"


def probe(tmp_path, mode: str, *, fresh: bool):
    out = tmp_path / f"{mode}-{'fresh' if fresh else 'delegated'}"
    out.mkdir()
    started = time.monotonic()
    proc = run_torchrun(PROBE, out, mode, nproc=2, env={"SCALETUNE_TEST_FORK": "0"} if fresh else None, timeout=120)
    return out, proc, time.monotonic() - started


def test_a_delegated_rank_sees_what_a_fresh_rank_sees(tmp_path):
    reports = {}
    for fresh in (True, False):
        out, proc, _ = probe(tmp_path, "report", fresh=fresh)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "rank 0 reporting" in proc.stdout and "rank 1 reporting" in proc.stdout
        reports[fresh] = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for fresh_rank, delegated_rank in zip(reports[True], reports[False]):
        # the control: the fresh rank imported nothing heavy, the delegated one is a fork of the zygote
        assert fresh_rank.pop("started_as") == "fresh"
        assert delegated_rank.pop("started_as") == "delegated"  # else a refusal's reason
        assert fresh_rank.pop("torch_imported") is False
        assert delegated_rank.pop("torch_imported") is True
        for report in (fresh_rank, delegated_rank):
            report["env"].pop("MASTER_PORT")  # each torchrun's own free port
            report["argv"][1] = report["orig_argv_tail"][2] = "OUT"  # each run's own folder
        assert delegated_rank == fresh_rank
    assert reports[True][0]["stdout"]["write_through"]  # torchrun's `-u`, kept by the delegated rank


@pytest.mark.parametrize(("mode", "exitcode"), [("fail", 3), ("killed", -9)])
def test_a_delegated_ranks_end_reaches_torchrun_and_its_sigterm_reaches_the_others(tmp_path, mode, exitcode):
    for fresh in (True, False):
        out, proc, seconds = probe(tmp_path, mode, fresh=fresh)
        assert proc.returncode != 0
        assert f"exitcode: {exitcode}" in proc.stderr, proc.stderr[-3000:]
        assert (out / "waiting-1").is_file()  # rank 1 was waiting when rank 0 ended; torchrun ended it
        assert seconds < 60, f"{'fresh' if fresh else 'delegated'}: {seconds:.0f} s"


def test_a_process_started_as_a_job_is_rehomed_as_a_fresh_one(tmp_path):
    zygote_home = hf_home(SESSION_ENVIRON or os.environ)
    job = {"HF_HOME": str(tmp_path / "job" / "hf"), "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}
    reports = {}
    for fresh in (True, False):
        out = tmp_path / ("fresh" if fresh else "delegated")
        out.mkdir()
        env = {**job, "SCALETUNE_TEST_FORK": "0"} if fresh else job
        proc = run_python(PROBE, out, "places", zygote_home, env=env, cwd=tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports[fresh] = json.loads((out / "places.json").read_text())
    assert reports[True].pop("torch_imported") is False
    assert reports[False].pop("torch_imported") is True  # else the zygote refused it (SCALETUNE_PROCESS_LOG says why)
    assert reports[True]["bindings"]["huggingface_hub.constants.HF_HUB_CACHE"] == str(tmp_path / "job" / "hf" / "hub")
    assert str(tmp_path) not in " ".join(reports[True]["path"])  # PYTHONSAFEPATH: no working directory first
    assert reports[False] == reports[True]
