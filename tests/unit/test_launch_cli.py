"""The launch verbs of the command line: thin wrappers, exit code 2 on bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"


def run(*args, cwd=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "scaletune", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


@pytest.fixture
def config(tmp_path):
    p = tmp_path / "my config.yaml"
    p.write_text(
        "output_dir: runs/x\nmodel: {name_or_path: m}\ndata: {dummy: {num_samples: 8}, max_seq_length: 16}\n"
        # 64 sequences per step split evenly over the 16 ranks of the largest job below
        "training: {global_batch_size: 64}\n"
        "distributed: {env: {HF_TOKEN: hf_zzz, NCCL_SOCKET_IFNAME: eth0}}\n"
    )
    return p


def test_launch_dry_run(config, tmp_path):
    r = run(
        "launch",
        config,
        "training.max_steps=2",
        "--gpus-per-node",
        "0",
        "--procs-per-node",
        "2",
        "--dry-run",
        "--python",
        "py",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "hf_zzz" not in r.stdout
    assert "export NCCL_SOCKET_IFNAME=eth0" in r.stdout
    assert r.stdout.rstrip().endswith(
        f"py -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 2 -m scaletune train '{config}' training.max_steps=2"
    )


def test_launch_script(config, tmp_path):
    out = tmp_path / "node1.sh"
    r = run(
        "launch",
        config,
        "--nodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.5",
        "--gpus-per-node",
        "4",
        "--script",
        out,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert os.access(out, os.X_OK) and "hf_zzz" not in text and "HF_TOKEN" in text
    assert "--rdzv-endpoint 10.0.0.5:29500" in text and "--node-rank 1" in text
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "2", "--node-rank", "2", "--master-addr", "h"], "outside 0..1"),
        (["--master-port", "70000"], "between 1 and 65535"),
        (["--gpus-per-node", "0"], "needs --procs-per-node"),
        (["--env-preset", "warp"], "unknown env preset"),
    ],
)
def test_launch_bad_input_exit_2(config, args, message):
    r = run("launch", config, *args, "--dry-run")
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_launch_bad_config_exit_2(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: {name_or_path: m}\ndata: {dummy: {num_samples: 8}}\ntraining: {bogus: 1}\n")
    r = run("launch", p, "--dry-run")
    assert r.returncode == 2 and "bogus" in r.stderr


def test_slurm_prints_and_writes(config, tmp_path):
    r = run(
        "slurm",
        config,
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--time",
        "1-00:00:00",
        "--partition",
        "gpu",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert '#SBATCH --time="1-00:00:00"' in r.stdout and f'#SBATCH --chdir="{tmp_path}"' in r.stdout
    assert "hf_zzz" not in r.stdout
    out = tmp_path / "job.sbatch"
    r = run("slurm", config, "--nodes", "1", "--gpus-per-node", "0", "--procs-per-node", "2", "-o", out, cwd=tmp_path)
    assert r.returncode == 0 and out.is_file() and r.stdout.strip() == str(out)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus-per-node", "0"], "needs --procs-per-node"),
        (["--gpus-per-node", "8", "--time", "25:99:00"], "--time"),
        (["--gpus-per-node", "8", "--env-preset", "x"], "unknown env preset"),
        ([], "--gpus-per-node is required"),
    ],
)
def test_slurm_bad_input_exit_2(config, args, message):
    r = run("slurm", config, *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_slurm_submit_without_sbatch_is_exit_2(config, tmp_path):
    r = run("slurm", config, "--gpus-per-node", "1", "--submit", cwd=tmp_path, env={"PATH": "/nonexistent"})
    assert r.returncode == 2 and "sbatch not found" in r.stderr


def test_modal_writes_app(config, tmp_path):
    pytest.importorskip("modal")
    out = tmp_path / "app.py"
    r = run("modal", config, "--gpu-count", "4", "--gpu-type", "a100-80gb", "-o", out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "GPU_TYPE = 'A100-80GB'" in text and "GPU_COUNT = 4" in text and "hf_zzz" not in text
    assert "HF_TOKEN" in r.stderr  # warned: put it in a Modal secret
    r = run("modal", config, "--gpu-count", "16")
    assert r.returncode == 2 and "--gpu-count" in r.stderr


def test_config_fsdp_cli(tmp_path):
    r = run("config", "fsdp", "--no-reshard-after-forward", "--mixed-precision", "fp16", "--format", "accelerate")
    assert r.returncode == 0 and "fsdp_reshard_after_forward: false" in r.stdout and "mixed_precision: fp16" in r.stdout
    r = run("config", "fsdp", "--mixed-precision", "fp8")
    assert r.returncode == 2
