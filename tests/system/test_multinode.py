"""Two "nodes" on loopback: two `scaletune launch --nodes 2 --node-rank 0|1` processes meet in a
c10d rendezvous on 127.0.0.1 and train with world size 2; and torchrun's `--max-restarts`
restarting the job after one rank is killed."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from scaletune.launch.commands import LaunchOptions, build_launch
from scaletune.serve.jobs.dispatch.local import descendants
from scaletune.strategies.base import free_port
from tests.helpers import wait_for
from tests.system.system_helpers import (
    PAYLOAD,
    assert_trains_like_reference,
    start,
    stop,
    system_config,
    wait_all,
)

pytestmark = [pytest.mark.system]


def node_argv(node_rank: int, port: int, program: tuple[str, ...]) -> list[str]:
    opts = LaunchOptions(
        config="-",
        nodes=2,
        node_rank=node_rank,
        gpus_per_node=0,
        procs_per_node=1,
        master_addr="127.0.0.1",
        master_port=port,
        python=sys.executable,
        program=program,
    )
    return build_launch(opts).argv


def test_two_nodes_on_loopback_payload(tmp_path):
    """The builder's multi-node argv: worker started first, master second; both join, world size 2."""
    port = free_port()
    out = tmp_path / "out"
    procs = []
    try:
        for rank in (1, 0):  # the worker waits for the master's store
            procs.append(
                start(node_argv(rank, port, (str(PAYLOAD), str(out))), cwd=tmp_path, log=tmp_path / f"node{rank}.log")
            )
            time.sleep(1)
        codes = wait_all(procs, timeout=120)
    finally:
        for p in procs:
            stop(p)
    logs = {r: (tmp_path / f"node{r}.log").read_text()[-3000:] for r in (0, 1)}
    assert codes == [0, 0], logs
    ranks = sorted(json.loads(p.read_text())["rank"] for p in out.glob("rank-*.json"))
    assert ranks == [0, 1]
    for p in out.glob("rank-*.json"):
        r = json.loads(p.read_text())
        assert r["world_size"] == 2 and r["local_rank"] == 0 and r["sum"] == 3.0


def _two_nodes(tmp_path: Path, cfg_path: Path, *launcher_args: str) -> dict[int, str]:
    """Two `scaletune launch --nodes 2` processes (node ranks 0 and 1, one CPU rank each) meeting
    on 127.0.0.1; both must exit 0. Returns the tail of each node's log."""
    port = free_port()
    procs = []
    try:
        for rank in (0, 1):
            argv = [
                sys.executable,
                "-m",
                "scaletune",
                "launch",
                cfg_path,
                *launcher_args,
                "--nodes",
                "2",
                "--node-rank",
                str(rank),
                "--gpus-per-node",
                "0",
                "--procs-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
            ]
            procs.append(start(argv, cwd=tmp_path, log=tmp_path / f"node{rank}.log"))
        codes = wait_all(procs, timeout=240)
    finally:
        for p in procs:
            stop(p)
    logs = {r: (tmp_path / f"node{r}.log").read_text()[-4000:] for r in (0, 1)}
    assert codes == [0, 0], logs
    return logs


def test_two_nodes_on_loopback_train_like_one_process(tmp_path, tiny_model_dir, reference_run):
    """`scaletune launch --nodes 2 --procs-per-node 1 --node-rank 0|1 --master-addr 127.0.0.1`:
    the loss and gradient norm per step equal the single-process run's within 1e-4, and so do
    final/'s logits."""
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(system_config(tiny_model_dir, tmp_path / "run")))
    _two_nodes(tmp_path, cfg_path)
    assert_trains_like_reference(tmp_path / "run", reference_run)


def _rank_of(pid: int) -> int | None:
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def test_max_restarts_restarts_after_a_rank_is_killed_payload(tmp_path):
    """`--max-restarts 1`: SIGKILL one rank of the first attempt; torchrun restarts the group,
    whose second attempt (TORCHELASTIC_RESTART_COUNT=1) completes.

    The payload namespaces its process-group store by attempt (`--prefix-store`): torchrun keeps
    one store across restarts, and without the prefix a restarted gloo rank can read the address
    the killed attempt published ("Connection refused"; pytorch/pytorch#167288)."""
    out = tmp_path / "out"
    opts = LaunchOptions(
        config="-",
        gpus_per_node=0,
        procs_per_node=2,
        max_restarts=1,
        python=sys.executable,
        program=(str(PAYLOAD), str(out), "--wait-first-attempt", "--prefix-store"),
    )
    proc = start(build_launch(opts).argv, cwd=tmp_path, log=tmp_path / "launch.log")
    try:
        pid = int(wait_for(lambda: (out / "pid-1").is_file() and (out / "pid-1").read_text(), 90, "rank 1 to start"))
        os.kill(pid, signal.SIGKILL)
        codes = wait_all([proc], timeout=120)
    finally:
        stop(proc)
    log = (tmp_path / "launch.log").read_text()
    assert codes == [0], log[-4000:]
    for i in (0, 1):
        r = json.loads((out / f"rank-{i}.json").read_text())
        assert r["attempt"] == 1 and r["world_size"] == 2 and r["sum"] == 3.0
    assert "exitcode: -9" in log  # torchrun saw the killed rank


def test_max_restarts_resumes_training_after_a_rank_is_killed(tmp_path, tiny_model_dir, reference_run):
    """`scaletune launch --max-restarts 1` on real training: SIGKILL rank 1 once the step-4
    checkpoint is recorded; torchrun restarts both ranks, they resume from that checkpoint by
    themselves, and the 8 logged steps (loss, gradient norm) and final/ equal the uninterrupted
    single-process run's within 1e-4, with no half-written checkpoint left behind."""
    cfg = system_config(tiny_model_dir, tmp_path / "run")
    assert cfg["training"]["save_every"] == 4
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    argv = [
        sys.executable,
        "-m",
        "scaletune",
        "launch",
        cfg_path,
        "--gpus-per-node",
        "0",
        "--procs-per-node",
        "2",
        "--max-restarts",
        "1",
    ]
    proc = start(argv, cwd=tmp_path, log=tmp_path / "launch.log")
    latest = tmp_path / "run" / "checkpoints" / "latest"
    try:
        wait_for(lambda: latest.is_file() and latest.read_text().strip() == "step-4", 180, "the step-4 checkpoint")
        rank1 = wait_for(lambda: [p for p in descendants(proc.pid) if _rank_of(p) == 1], 30, "rank 1's process")[0]
        os.kill(rank1, signal.SIGKILL)
        codes = wait_all([proc], timeout=240)
    finally:
        stop(proc)
    log = (tmp_path / "launch.log").read_text()
    assert codes == [0], log[-6000:]
    assert "exitcode: -9" in log, log[-4000:]  # torchrun saw the killed rank and restarted
    assert "restarted by torchrun: resuming" in log and "resumed from" in log
    assert_trains_like_reference(tmp_path / "run", reference_run)
    leftovers = [p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == [], leftovers
    assert (tmp_path / "run" / "final").is_dir()


def test_two_nodes_on_loopback_with_the_deepspeed_launcher(tmp_path, tiny_model_dir, reference_run):
    """`scaletune launch --launcher deepspeed --nodes 2 ...`: each node runs DeepSpeed's launcher
    with --no_ssh, --node_rank and the hostfile scaletune writes; same loss as one process."""
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(system_config(tiny_model_dir, tmp_path / "run")))
    logs = _two_nodes(tmp_path, cfg_path, "--launcher", "deepspeed")
    assert "deepspeed.launcher.runner" in logs[0] or "launch.py" in logs[0]
    assert_trains_like_reference(tmp_path / "run", reference_run)
