"""Running the real CLI in a subprocess and reading what a run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ALPACA_5000, REPO_ROOT


def base_config(model_dir: Path, out: Path, **sections: Any) -> dict:
    """A small fp32 config on real Alpaca records: 8 sequences per step, 8 steps saving a
    checkpoint at step 4 (and at the end), seq 64."""
    cfg: dict[str, Any] = {
        "output_dir": str(out),
        "seed": 1234,
        "model": {
            "name_or_path": str(model_dir),
            "dtype": "float32",
            "attn_implementation": "sdpa",
            "gradient_checkpointing": False,
        },
        "data": {
            "train": {"path": str(ALPACA_5000), "format": "alpaca", "max_samples": 64},
            "max_seq_length": 64,
        },
        "training": {
            "global_batch_size": 8,
            "micro_batch_size": 2,
            "max_steps": 8,
            "learning_rate": 2.0e-3,
            "lr_scheduler": "cosine",
            "warmup_steps": 2,
            "max_grad_norm": 1.0,
            "eval_every": 0,
            "save_every": 4,
            "log_every": 1,
        },
        "distributed": {"strategy": "single", "num_processes": 1},
        "logging": {"tensorboard": False},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def run_cli(
    args: list[str], *, timeout: int = 600, env: dict | None = None, cwd: Path | None = None, input: str | None = None
) -> subprocess.CompletedProcess:
    """`python -m scaletune ARGS` with the test environment (offline, DeepSpeed on the CPU); `input`
    is its standard input (none: an empty one)."""
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "scaletune", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd or REPO_ROOT,
        input=input if input is not None else "",
    )


def train(
    cfg: dict, tmp_path: Path, *, name: str = "config.yaml", expect_ok: bool = True, **kw
) -> subprocess.CompletedProcess:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    proc = run_cli(["train", str(path)], **kw)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(
            f"scaletune train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def metrics(run_dir: Path | str) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


# Gradient norms of a full fine-tune agree across engines only to a few 1e-4: the float32 norm of
# the head's gradient (100,352 x 64 values) is itself accurate to ~3e-4 on the CPU (step 1 of the
# base config: 1.032107 in float32, 1.032413 in float64), and the engines sum it differently
# (single and DDP: the whole tensor, reported 1.903663; FSDP: per shard, 1.903743; DeepSpeed
# ZeRO: 1.903829 = the float64 total). The losses, and every parameter's gradient, agree to 1e-7.
GRAD_REL = 5e-4


def steps(run_dir: Path | str) -> list[dict]:
    """The metrics.jsonl lines of optimizer steps (not eval lines)."""
    return [m for m in metrics(run_dir) if "loss" in m]


def losses(run_dir: Path | str) -> list[float]:
    return [m["loss"] for m in steps(run_dir)]


def grad_norms(run_dir: Path | str) -> list[float]:
    return [m["grad_norm"] for m in steps(run_dir)]


def assert_same_steps(
    run_dir: Path | str, ref_dir: Path | str, rel: float, what: str, *, first: int = 0, grad_rel: float | None = None
) -> None:
    """Every logged step of `run_dir` has the loss and the gradient norm of `ref_dir`'s step of
    the same number (`ref_dir`'s steps from index `first` on): within `rel` (`grad_rel` for the
    norm, default `rel`), relative. The norm is taken before clipping, so it sees a gradient that
    clipping would hide from the loss."""
    got, ref = steps(run_dir), steps(ref_dir)[first:]
    assert [m["step"] for m in got] == [m["step"] for m in ref], f"{what}: steps {[m['step'] for m in got]}"
    assert_close([m["loss"] for m in got], [m["loss"] for m in ref], rel, f"{what}: loss")
    assert_close([m["grad_norm"] for m in got], [m["grad_norm"] for m in ref], grad_rel or rel, f"{what}: grad_norm")


def logits(model_dir: Path, adapter: bool = False):
    """Logits of a saved model (or of a LoRA adapter over its base) on a fixed batch of 2 x 16 ids."""
    import torch

    if adapter:
        from peft import AutoPeftModelForCausalLM as Auto
    else:
        from transformers import AutoModelForCausalLM as Auto
    model = Auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(3, 35).reshape(2, 16)).logits


def assert_same_logits(a, b, what: str) -> None:
    import torch

    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), f"{what}: max logit difference {(a - b).abs().max():.2e}"


def assert_close(actual: list[float], expected: list[float], rel: float, what: str) -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} steps vs {len(expected)}"
    worst = max(abs(a - e) / max(abs(e), 1e-12) for a, e in zip(actual, expected))
    assert worst <= rel, (
        f"{what}: worst relative difference {worst:.2e} > {rel:.0e}\n actual   {actual}\n expected {expected}"
    )


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    """Poll `predicate()` every `interval` seconds until it returns something truthy, and return
    that; fail the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def run_bench(tmp_path: Path, preset: str, *args: str, timeout: int) -> tuple[dict, str]:
    """Run benchmarks/bench.py with `--preset PRESET ARGS`, its models cached under tmp_path;
    returns (the JSON report it wrote, its stdout), failing the test with its stderr when it exits
    non-zero."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "bench.py"), "--preset", preset, *args]
    cmd += ["--cache", str(tmp_path / "models"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def save_random_llama(out: Path, tokenizer_file: Path, *, seed: int = 0, **config: Any) -> Path:
    """A `LlamaConfig(**config)` model with random float32 weights (drawn after
    `torch.manual_seed(seed)`) saved to `out` with a tokenizer over `tokenizer_file`, whose
    `model_max_length` is the config's `max_position_embeddings`: a folder `from_pretrained` loads."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from scaletune.models import _tokenizer_from_file

    llama = LlamaConfig(**config)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(llama, dtype=torch.float32).save_pretrained(out)
    _tokenizer_from_file(tokenizer_file, model_max_length=llama.max_position_embeddings).save_pretrained(out)
    return out
