"""`scaletune train` refuses a run its preflight rejects before anything is loaded or written: exit
2, one message, no traceback (moved from tests/unit, which starts no process; the rules themselves
are tested in-process in tests/unit/test_doctor.py and tests/unit/test_gpu_paths.py)."""

from __future__ import annotations

import pytest
import torch
import yaml

from tests.helpers import make_config, run_cli


def test_cli_train_with_liger_on_this_cpu_exits_2_before_loading(tmp_path, tiny_model_dir):
    """The real CLI, the real preflight: one message, exit 2, no traceback, nothing written."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    out = tmp_path / "run"
    path = tmp_path / "liger.yaml"
    path.write_text(yaml.safe_dump(make_config(tiny_model_dir, out, model={"liger": True})))
    proc = run_cli(["train", str(path)], timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        "cannot start training" in proc.stderr
        and "model.liger (Liger's Triton kernels) needs a CUDA GPU" in proc.stderr
    )
    assert "set model.liger: false" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists(), "the run directory was written before the check"
    assert "trainable" not in proc.stdout + proc.stderr, "the model was loaded before the check"


def test_fsdp_with_quantization_is_refused_with_the_alternative(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    cfg = make_config(
        tiny_model_dir,
        out,
        model={"dtype": "bfloat16", "lora": {"r": 8}, "quantization": {"bits": 4, "storage_dtype": "bfloat16"}},
        distributed={"strategy": "fsdp", "num_processes": 2},
    )
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = run_cli(["train", str(path)], timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "model.quantization cannot run under strategy fsdp" in proc.stderr
    assert "use strategy ddp" in proc.stderr and "zero_stage 3" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()
