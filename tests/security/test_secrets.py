"""Secrets never land in a file scaletune writes, a log line or a generated script: a real run and
every generator are given secrets by name pattern, by `distributed.secret_env`, in the YAML and on
the command line, and every byte they produce is searched for the values."""

from __future__ import annotations

from pathlib import Path

import yaml

from scaletune.config import is_secret_name
from tests.helpers import make_config, run_cli

SECRETS = {"HF_TOKEN": "hf_s3cr3tA", "DB_PASS": "pw-s3cr3tB", "OPENAI_KEY": "sk-s3cr3tC", "PRIVATE_KEY": "pk-s3cr3tD"}
CUSTOM = ("MY_CUSTOM", "plain-s3cr3tE")  # named in distributed.secret_env, its name says nothing


def leaks(text: str) -> list[str]:
    return [v for v in [*SECRETS.values(), CUSTOM[1]] if v in text]


def every_byte(root: Path) -> str:
    """Every file under `root`, bytes as latin-1 (binary files included: event files, shards)."""
    return "\n".join(p.read_bytes().decode("latin-1") for p in root.rglob("*") if p.is_file())


def test_name_detection():
    for name in (*SECRETS, "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "GITHUB_PAT", "apiKey"):
        assert is_secret_name(name), name
    for name in ("NCCL_DEBUG", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "NCCL_IB_PASSIVE", "KEYCLOAK_URL"):
        assert not is_secret_name(name), name
    assert is_secret_name("MY_CUSTOM", ["MY_CUSTOM"])


def config_with_secrets(model_dir: Path, out: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    cfg = make_config(model_dir, out, training={"max_steps": 2, "save_every": 1},
                      distributed={"strategy": "ddp", "num_processes": 2, "secret_env": [CUSTOM[0]]},
                      logging={"tensorboard": True})  # fmt: skip
    cfg["distributed"]["env"] = {"DB_PASS": SECRETS["DB_PASS"], CUSTOM[0]: CUSTOM[1], "NCCL_DEBUG": "WARN"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    overrides = [f"distributed.env.{k}={SECRETS[k]}" for k in ("HF_TOKEN", "OPENAI_KEY", "PRIVATE_KEY")]
    return path, overrides


def test_a_run_writes_and_logs_no_secret(tiny_model_dir, tmp_path):
    """Two ranks started by the torchrun re-exec (whose log line names the environment it sets),
    checkpoints, TensorBoard, final/: no secret value anywhere, and the run's config names them."""
    run = tmp_path / "run"
    path, overrides = config_with_secrets(tiny_model_dir, run, tmp_path)
    proc = run_cli(["train", str(path), *overrides])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not leaks(proc.stdout + proc.stderr), "a secret reached the log"
    assert "HF_TOKEN=<secret>" in proc.stderr  # the re-exec says it passes it, by name
    assert not leaks(every_byte(run)), "a secret reached the run directory"
    saved = yaml.safe_load((run / "config.yaml").read_text())["distributed"]["env"]
    # The ranks got the command line's secrets through their environment, not their config.
    assert saved["DB_PASS"] == saved[CUSTOM[0]] == "<redacted>" and saved["NCCL_DEBUG"] == "WARN"
    assert "HF_TOKEN" not in saved
    assert (run / "checkpoints" / "step-2" / "config.yaml").is_file()


def test_generators_write_no_secret(tiny_model_dir, tmp_path):
    path, overrides = config_with_secrets(tiny_model_dir, tmp_path / "run", tmp_path)
    outputs = {
        "sbatch": ["slurm", str(path), *overrides, "--gpus-per-node", "0", "--procs-per-node", "2", "-o", str(tmp_path / "j.sbatch")],
        "script": ["launch", str(path), *overrides, "--gpus-per-node", "0", "--procs-per-node", "2", "--script", str(tmp_path / "l.sh")],
        "dry-run": ["launch", str(path), *overrides, "--gpus-per-node", "0", "--procs-per-node", "2", "--dry-run"],
        "modal": ["modal", str(path), *overrides, "--gpu-count", "2", "-o", str(tmp_path / "app.py")],
        "show": ["config", "show", str(path), *overrides],
    }  # fmt: skip
    for what, args in outputs.items():
        proc = run_cli(args, cwd=tmp_path)
        assert proc.returncode == 0, f"{what}: {proc.stderr[-2000:]}"
        assert not leaks(proc.stdout + proc.stderr), f"{what} printed a secret"
    text = "".join((tmp_path / f).read_text() for f in ("j.sbatch", "l.sh", "app.py"))
    assert not leaks(text), "a generated file holds a secret"
    sbatch = (tmp_path / "j.sbatch").read_text()
    assert "HF_TOKEN+x" in sbatch and "NCCL_DEBUG=WARN" in sbatch  # passed through by name; public values written
