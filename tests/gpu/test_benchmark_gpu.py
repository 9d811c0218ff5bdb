"""The gpu-1b benchmark preset runs every trainer on the GPU (a smoke run of a few steps; the
measurement itself is `scripts/gpu_check.sh`)."""

from __future__ import annotations

from tests.helpers import run_bench


def test_gpu_1b_benchmark_smoke(tmp_path):
    r, _ = run_bench(tmp_path, "gpu-1b", "--warmup", "1", "--steps", "2", timeout=1800)
    assert r["tied_head"] and r["peak"]["dtype"] == "bfloat16"
    for name, x in r["trainers"].items():
        assert x["tokens"] > 0 and 0 < x["mfu"] < 1 and x["peak_memory_kind"] == "cuda allocated", name
