"""Packed rows on one GPU, the 0.34B Llama at 1,024 tokens a row in bf16: the default attention
(flex_attention on CUDA) against `sdpa` written in the config, and gradient checkpointing as the
planner decides it (`auto`: off where the plan fits) against `true`. The losses must agree (the
control is the sdpa run); the tokens/s are a measurement, written to $SCALETUNE_GPU_REPORT/throughput.json
for scripts/gpu_check.sh's report. Run it alone (pytest -n 0): other runs on the GPU would skew it."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from tests.helpers import ALPACA_5000, assert_close, make_config, metrics, train

RUNS = {
    "flex (default), checkpointing auto": {},
    "sdpa, checkpointing auto": {"attn_implementation": "sdpa"},
    "flex (default), checkpointing on": {"gradient_checkpointing": True},
}


def test_packed_throughput_flex_vs_sdpa_and_checkpointing(mid_model_dir, tmp_path):
    results = {}
    for i, (name, model) in enumerate(RUNS.items()):
        out = tmp_path / f"run{i}"
        cfg = make_config(
            mid_model_dir,
            out / "run",
            {"model": {"attn_implementation": None, "gradient_checkpointing": "auto"}},
            model={"dtype": "bfloat16", **model},
            data={"packing": True, "max_seq_length": 1024, "train": {"path": str(ALPACA_5000), "format": "alpaca"}},
            training={"global_batch_size": 8, "micro_batch_size": 4, "max_steps": 10, "save_every": 0},
        )
        out.mkdir()
        proc = train(cfg, out)
        rows = [m for m in metrics(out / "run") if "loss" in m]
        results[name] = {
            "loss": [m["loss"] for m in rows],
            "tokens_per_s_median_steps_3_on": statistics.median(m["tokens_per_s"] for m in rows[2:]),
            "start_lines": [
                line for line in proc.stderr.splitlines() if "attention" in line or "checkpointing" in line
            ],
        }
    report = Path(os.environ.get("SCALETUNE_GPU_REPORT", tmp_path))
    (report / "throughput.json").write_text(json.dumps(results, indent=1))
    control = results["sdpa, checkpointing auto"]["loss"]
    assert control[-1] < control[0] - 0.3
    for name, r in results.items():
        assert_close(r["loss"], control, 3e-2, f"{name} vs sdpa")
