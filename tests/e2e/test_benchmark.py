"""The benchmark harness (benchmarks/bench.py) in its smoke configuration: every trainer runs, the
numbers it reports are consistent, and scaletune and the bare loop really train the same model on
the same batches. A generous floor, not a timing claim (docs/benchmarks.md has the measurements)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from tests.conftest import REPO_ROOT


def test_benchmark_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "bench.py"),
            "--preset",
            "smoke",
            "--cache",
            str(tmp_path / "models"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    t = r["trainers"]
    assert set(t) == {"hf", "bare", "scaletune"}
    steps = r["spec"]["steps"]
    for name, x in t.items():
        assert x["tokens"] > 0 and x["seconds"] > 0, name
        assert math.isclose(x["tokens_per_s"], x["tokens"] / x["seconds"]), name
        assert 0 < x["mfu"] < 1, name
        assert x["peak_memory_bytes"] > 2**20, name
        # A random model starts at the uniform loss, ln(vocab): the same model in all three.
        assert abs(x["first_loss"] - math.log(100_352)) < 0.5, (name, x["first_loss"])
    # Same weights, same sampler, same loss: the bare loop's first step is scaletune's first step.
    assert math.isclose(t["bare"]["first_loss"], t["scaletune"]["first_loss"], rel_tol=1e-5)
    # Packed rows of at most micro x seq tokens per step: the token count cannot exceed that.
    assert t["scaletune"]["tokens"] <= steps * r["spec"]["micro_batch_size"] * r["spec"]["max_seq_length"]
    assert t["scaletune"]["tokens"] == t["bare"]["tokens"]
    assert r["peak"]["flops_per_s"] > 1e9
    assert r["speedup_vs_hf"] > 0.5 and r["overhead_vs_bare"] < 0.5  # generous floors
    assert "scaletune / HF Trainer" in proc.stdout and "MFU" in proc.stdout
