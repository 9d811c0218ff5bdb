"""The launch verbs of the command line in a subprocess: thin wrappers, exit code 2 on bad input
(moved from tests/unit, which starts no process)."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from tests.helpers import make_config, run_cli


@pytest.fixture
def config(tmp_path):
    """make_config's config at a path with a space, the strategy and process count left to the
    launcher, 64 sequences a step (split evenly over the 16 ranks of the largest job below) and a
    secret and a plain variable in distributed.env."""
    p = tmp_path / "my config.yaml"
    cfg = make_config(
        "m",
        "runs/x",
        training={"global_batch_size": 64},
        distributed={
            "strategy": None,
            "num_processes": None,
            "env": {"HF_TOKEN": "hf_zzz", "NCCL_SOCKET_IFNAME": "eth0"},
        },
    )
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_launch_dry_run(config, tmp_path):
    r = run_cli(
        [
            "launch",
            str(config),
            "training.max_steps=2",
            "--gpus-per-node",
            "0",
            "--procs-per-node",
            "2",
            "--dry-run",
            "--python",
            "py",
        ],
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
    r = run_cli(
        [
            "launch",
            str(config),
            "--nodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "10.0.0.5",
            "--gpus-per-node",
            "4",
            "--script",
            str(out),
        ],
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
    r = run_cli(["launch", str(config), *args, "--dry-run"])
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_launch_bad_config_exit_2(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: {name_or_path: m}\ndata: {dummy: {num_samples: 8}}\ntraining: {bogus: 1}\n")
    r = run_cli(["launch", str(p), "--dry-run"])
    assert r.returncode == 2 and "bogus" in r.stderr


def test_slurm_prints_and_writes(config, tmp_path):
    r = run_cli(
        ["slurm", str(config), "--nodes", "2", "--gpus-per-node", "8", "--time", "1-00:00:00", "--partition", "gpu"],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert '#SBATCH --time="1-00:00:00"' in r.stdout and f'#SBATCH --chdir="{tmp_path}"' in r.stdout
    assert "hf_zzz" not in r.stdout
    out = tmp_path / "job.sbatch"
    r = run_cli(
        ["slurm", str(config), "--nodes", "1", "--gpus-per-node", "0", "--procs-per-node", "2", "-o", str(out)],
        cwd=tmp_path,
    )
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
    r = run_cli(["slurm", str(config), *args])
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_slurm_submit_without_sbatch_is_exit_2(config, tmp_path):
    r = run_cli(["slurm", str(config), "--gpus-per-node", "1", "--submit"], cwd=tmp_path, env={"PATH": "/nonexistent"})
    assert r.returncode == 2 and "sbatch not found" in r.stderr


def test_modal_writes_app(config, tmp_path):
    pytest.importorskip("modal")
    out = tmp_path / "app.py"
    r = run_cli(["modal", str(config), "--gpu-count", "4", "--gpu-type", "a100-80gb", "-o", str(out)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "GPU_TYPE = 'A100-80GB'" in text and "GPU_COUNT = 4" in text and "hf_zzz" not in text
    assert "HF_TOKEN" in r.stderr  # warned: put it in a Modal secret
    r = run_cli(["modal", str(config), "--gpu-count", "16"])
    assert r.returncode == 2 and "--gpu-count" in r.stderr


def test_config_fsdp_cli(tmp_path):
    r = run_cli(["config", "fsdp", "--no-reshard-after-forward", "--mixed-precision", "fp16", "--format", "accelerate"])
    assert r.returncode == 0 and "fsdp_reshard_after_forward: false" in r.stdout and "mixed_precision: fp16" in r.stdout
    r = run_cli(["config", "fsdp", "--mixed-precision", "fp8"])
    assert r.returncode == 2
