"""The benchmark harness (benchmarks/bench.py) in its smoke configuration: every trainer runs (TRL's
SFTTrainer, HF Trainer, the bare loop, scaletune), the numbers it reports are consistent, and
scaletune and the bare loop really train the same model on the same batches. A generous floor, not
a timing claim (docs/benchmarks.md has the measurements). And the FLOPs formula's N, checked
against the parameters of real configs."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

from tests.helpers import REPO_ROOT, run_bench


def bench_module():
    spec = importlib.util.spec_from_file_location("bench", REPO_ROOT / "benchmarks" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_flops_count_the_head_once_tied_or_not():
    """N is every matmul weight: all parameters but the input embedding table, the head included.
    Llama-3.2-1B ties its head to the embeddings (one tensor in the parameter count); Llama-3-8B
    does not. 6N is checked against the sum over the real modules' Linear weights."""
    from transformers import AutoModelForCausalLM

    from scaletune.models import preset_config

    bench = bench_module()
    for preset, tied in (("llama-3.2-1b", True), ("llama-3-8b", False)):
        config = preset_config(preset)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert bool(config.tie_word_embeddings) is tied
        total = sum(p.numel() for p in model.parameters())  # a tied tensor once
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        norms = total - linear - (0 if tied else model.get_input_embeddings().weight.numel())
        n = bench.model_flops_per_token(config, total, total, mean_context=0.0) / 6
        assert n == linear + norms  # the head (tied or not) in, the lookup out
        if tied:  # the old formula, total - V·d, dropped the head: 27% short for Llama-3.2-1B
            assert (linear + norms) / (total - config.vocab_size * config.hidden_size) > 1.25


@pytest.mark.slow  # a measurement harness (four trainers); the FLOPs rule above is the CI proof
def test_benchmark_smoke(tmp_path):
    r, stdout = run_bench(tmp_path, "smoke", timeout=600)
    t = r["trainers"]
    assert set(t) == {"trl", "hf", "bare", "scaletune"}
    steps = r["spec"]["steps"]
    for name, x in t.items():
        assert x["tokens"] > 0 and x["seconds"] > 0, name
        assert math.isclose(x["tokens_per_s"], x["tokens"] / x["seconds"]), name
        assert 0 < x["mfu"] < 1 and 0 < x["hfu"] <= x["mfu"], name
        assert x["peak_memory_bytes"] > 2**20, name
        # A random model starts at the uniform loss, ln(vocab): the same model in all three.
        assert abs(x["first_loss"] - math.log(100_352)) < 0.5, (name, x["first_loss"])
    # Same weights, same sampler, same loss: the bare loop's first step is scaletune's first step.
    assert math.isclose(t["bare"]["first_loss"], t["scaletune"]["first_loss"], rel_tol=1e-5)
    # Packed rows of at most micro x seq tokens per step: the token count cannot exceed that.
    assert t["scaletune"]["tokens"] <= steps * r["spec"]["micro_batch_size"] * r["spec"]["max_seq_length"]
    assert t["scaletune"]["tokens"] == t["bare"]["tokens"]
    assert r["peak"]["flops_per_s"] > 1e9
    assert r["speedup_vs_hf"] > 0.5 and r["speedup_vs_trl"] > 0.5 and r["overhead_vs_bare"] < 0.5  # generous floors
    assert "scaletune / TRL SFTTrainer" in stdout and "MFU" in stdout
    # The head runs at target positions only in scaletune: fewer FLOPs executed than the model's.
    assert r["executed_flops_per_token"] < r["flops_per_token"] and 0 < r["target_fraction"] < 1
