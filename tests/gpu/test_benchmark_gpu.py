"""The gpu-1b benchmark preset runs every trainer on the GPU (a smoke run of a few steps; the
measurement itself is `scripts/gpu_check.sh`)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO_ROOT


def test_gpu_1b_benchmark_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "bench.py"),
            "--preset",
            "gpu-1b",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--cache",
            str(tmp_path / "models"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["tied_head"] and r["peak"]["dtype"] == "bfloat16"
    for name, x in r["trainers"].items():
        assert x["tokens"] > 0 and 0 < x["mfu"] < 1 and x["peak_memory_kind"] == "cuda allocated", name
