"""`scaletune export --format gguf --verify`: the written GGUF file is loaded by llama.cpp itself, in
a fresh process (llama.cpp's server library through `xllamacpp`'s bindings, `pip install
'scaletune[llamacpp]'`), which continues the probe greedily; transformers scores the same tokens
with the exported float32 model (the weights the file was made from), teacher-forced
(`checkpoint.verify_runtime`: the two checks and their bound).

What it proves: the file stands alone in the runtime it is for: llama.cpp finds every tensor under
its name and in its layout (q/k permuted as its rope expects, the tied or untied head, the norms'
epsilon, the rope base), and computes the model that was trained.

Run as a module (`python -m scaletune.checkpoint.verify_gguf FILE IDS OUT`), this file is the fresh
process: it loads FILE in llama.cpp, continues the token ids of the JSON file IDS greedily and
writes the chosen ids, their log-probabilities and the library's version to the JSON file OUT.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from scaletune.checkpoint.verify_runtime import NEW_TOKENS, ContinuationCheck, fresh_answer, prompt_ids, score

# Largest |log-probability difference| of a chosen token, by the file's weight type, as a fraction of
# the spread of transformers' logits there (`checkpoint.verify_runtime`). f32 differs by kernels alone
# (llama.cpp's own matmul, rope and softmax); f16 and bf16 round every weight (2^-11, 2^-8 of it);
# q8_0 rounds each weight and each activation entering a matmul to 1/127 of its 32-value block's
# largest magnitude. Measured (|difference| / spread, for f32, f16, bf16, q8_0): the quickstart's
# SmolLM2-135M (trained, spread 3.5) 0.0006, 0.0009, 0.0044, 0.010; the tests' tiny Llama drawn with
# large weights (spread 1.6) 0.0035, 0.0037, 0.016, 0.10. The bounds are about twice the larger;
# Llama's q/k written without the permutation llama.cpp's rope expects is off by 5 spreads.
BOUNDS = {"f32": 0.01, "f16": 0.01, "bf16": 0.04, "q8_0": 0.2}


def require_llamacpp() -> None:
    """Raises RuntimeError naming the install when llama.cpp's bindings are missing."""
    try:
        import xllamacpp  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "--verify of a GGUF file loads it in llama.cpp through the xllamacpp bindings, which are not "
            "installed: pip install 'scaletune[llamacpp]'"
        ) from None


def verify_gguf(path: Path, model: torch.nn.Module, tokenizer: Any, gguf_type: str) -> ContinuationCheck:
    """Load the GGUF file `path` in llama.cpp in a fresh process, continue the probe there, and score
    the chosen tokens with `model` (the float32 model the file was made from).

    Raises:
        RuntimeError: the bindings are missing; the fresh process could not load the file or run it
            (its last lines).
    """
    require_llamacpp()
    prompt = prompt_ids(tokenizer)
    what = f"{path.name} did not load or run in llama.cpp"
    with tempfile.TemporaryDirectory(prefix="scaletune-verify-gguf-") as tmp:
        ids, out = Path(tmp) / "ids.json", Path(tmp) / "out.json"
        ids.write_text(json.dumps(prompt))
        argv = [sys.executable, "-m", "scaletune.checkpoint.verify_gguf", str(path), str(ids), str(out)]
        answer = fresh_answer(argv, out, what, env={"PYTHONSAFEPATH": "1"})
    return score(
        model,
        prompt,
        answer,
        BOUNDS[gguf_type],
        subject="the GGUF file",
        runtime="llama.cpp",
        reference="the exported float32 model",
        weights=gguf_type,
    )


def _fresh_process(path: str, ids_file: str, out: str) -> None:
    """The fresh process's side: llama.cpp loads the file and continues the prompt greedily, each
    chosen token with its log-probability (the top-1 of `n_probs`, before any sampling)."""
    from importlib.metadata import version

    import xllamacpp

    prompt = json.loads(Path(ids_file).read_text())
    params = xllamacpp.CommonParams()
    params.model.path = path
    params.n_ctx = len(prompt) + NEW_TOKENS + 8
    params.n_parallel = 1
    params.warmup = False
    params.cpuparams.n_threads = max(1, min(4, os.cpu_count() or 1))
    # The attention's keys and values kept in float32 (llama.cpp's default cache is f16, which would
    # add its own rounding to every type's): the check measures the file's weights.
    params.cache_type_k = params.cache_type_v = xllamacpp.ggml_type.GGML_TYPE_F32
    server = xllamacpp.Server(params)
    answer = server.handle_completions(
        {
            "prompt": prompt,  # token ids: the exported tokenizer's, as transformers is given them
            "n_predict": NEW_TOKENS,
            "temperature": 0.0,
            "top_k": 1,
            "n_probs": 1,
            "cache_prompt": False,
            "ignore_eos": True,  # an end-of-text token is one more token to compare, not the end
        }
    )
    if "choices" not in answer:
        raise RuntimeError(f"llama.cpp answered {json.dumps(answer)[:500]}")
    content = answer["choices"][0]["logprobs"]["content"]
    result = {
        "tokens": [int(t["id"]) for t in content],
        "logprobs": [float(t["logprob"]) for t in content],
        "versions": f"xllamacpp {version('xllamacpp')}",
    }
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    _fresh_process(*sys.argv[1:])
