"""`scaletune export --verify` for a Hugging Face folder: the written folder is loaded back in a
fresh process through transformers' own `AutoModelForCausalLM` (an adapter through peft's
`AutoPeftModelForCausalLM`), with nothing of scaletune's loader, and its logits on a probe text
are compared with the exporting process's model, the checkpoint as it was written.

What it proves: the folder stands alone in the runtime it is for: every tensor is there under the
name transformers looks for, the config describes the weights, an adapter's config finds its base
and applies as trained. A key renamed, a tensor left out (tied or untied head), a dtype or a LoRA
scale written wrong each moves the logits far beyond the bound.

Run as a module (`python -m scaletune.checkpoint.verify FOLDER IDS OUT`), this file is the fresh
process: it loads FOLDER, runs the token ids of the JSON file IDS and writes the logits to the
safetensors file OUT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The probe: Alpaca's first instruction and its answer (../shared/data, the tests' data; a text the
# tokenizer of any English model splits into a few dozen tokens).
PROBE_TEXT = (
    "Give three tips for staying healthy. 1. Eat a balanced and nutritious diet: make sure your meals "
    "are inclusive of a variety of fruits and vegetables, lean protein, whole grains, and healthy fats."
)
MAX_PROBE_TOKENS = 64

# Largest |logit difference| accepted, by the dtype the weights were written in. Both sides run the
# same arithmetic in that dtype on the CPU: the difference measured is 0 on the tiny models; the
# bound leaves room for a kernel that accumulates in another order, not for a wrong tensor (a swapped
# or missing one moves logits by whole units).
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@dataclass(frozen=True)
class Verification:
    """The result: `tokens` probe tokens, the largest |logit difference| `max_diff` against `bound`,
    the loader used (`loader`: "transformers AutoModelForCausalLM" or "peft AutoPeftModelForCausalLM")
    and the library versions that loaded it."""

    tokens: int
    max_diff: float
    bound: float
    dtype: str
    loader: str
    versions: str

    @property
    def passed(self) -> bool:
        return self.max_diff <= self.bound

    def sentence(self) -> str:
        """One line: what was loaded how, and the difference against its bound."""
        verdict = "passed" if self.passed else "FAILED"
        return (
            f"export --verify {verdict}: the folder, loaded in a fresh process with {self.loader} "
            f"({self.versions}), gives logits on {self.tokens} probe tokens within {self.max_diff:.3g} of the "
            f"exporting process's model (largest |difference|; bound {self.bound:g} for {self.dtype} weights)"
        )

    def failure(self) -> str:
        """What failed, for the refusal."""
        return (
            f"--verify: the exported folder's logits differ from the model written by {self.max_diff:.3g} "
            f"(bound {self.bound:g} for {self.dtype})"
        )


def readme_section(*checks: Callable[[], Any], notes: Sequence[str] = ()) -> str:
    """Run an export's checks in order (each `check()` returns a :class:`Verification` or a
    `verify_runtime.ContinuationCheck`), print each one's sentence, and return the README section
    recording them, with `notes` (what was not checked, and why) after them.

    Raises:
        RunFailure: a check could not run (its RuntimeError) or the export failed it; the caller
            then does not move the export into place.
    """
    from scaletune.env import print0
    from scaletune.errors import RunFailure

    sentences = []
    for check in checks:
        try:
            result = check()
        except RuntimeError as exc:
            raise RunFailure(f"{exc}\nnothing was written; the checkpoint is unchanged") from None
        print0(f"[scaletune] {result.sentence()}")
        if not result.passed:
            raise RunFailure(f"{result.failure()}; nothing was written; the checkpoint is unchanged")
        sentences.append(result.sentence())
    for note in notes:
        print0(f"[scaletune] {note}")
    return "\n## Verification\n\n" + "\n".join(f"{line}.\n" for line in [*sentences, *notes])


def probe_ids(tokenizer: Any) -> list[int]:
    """The probe's token ids ([:data:`MAX_PROBE_TOKENS`]) by the exported tokenizer."""
    ids = tokenizer(PROBE_TEXT, add_special_tokens=True)["input_ids"][:MAX_PROBE_TOKENS]
    assert ids, "the tokenizer gave no tokens for the probe text"
    return list(ids)


@torch.no_grad()
def logits_of(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """`model`'s logits for `ids` as one sequence: shape [len(ids), vocab], in the model's dtype."""
    model.eval()
    return model(input_ids=torch.tensor([ids])).logits[0]


def verify_folder(
    folder: Path, model: torch.nn.Module, tokenizer: Any, *, adapter: bool, trust_remote_code: bool
) -> Verification:
    """Load `folder` in a fresh Python process and compare its logits on the probe with `model`'s
    (the model just written to it, in the dtype written).

    Raises:
        RuntimeError: the fresh process could not load the folder or run it (its last lines).
    """
    ids = probe_ids(tokenizer)
    expected = logits_of(model, ids)
    with tempfile.TemporaryDirectory(prefix="scaletune-verify-") as tmp:
        (Path(tmp) / "ids.json").write_text(json.dumps(ids))
        argv = [sys.executable, "-m", "scaletune.checkpoint.verify", str(folder), str(Path(tmp) / "ids.json")]
        argv += [str(Path(tmp) / "logits.safetensors"), "adapter" if adapter else "model"]
        argv += ["trust-remote-code"] if trust_remote_code else []
        done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONSAFEPATH": "1"})
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"--verify: {folder} did not load in a fresh process:\n{tail}")
        from safetensors.torch import load_file

        got = load_file(str(Path(tmp) / "logits.safetensors"))["logits"]
    assert got.shape == expected.shape, (got.shape, expected.shape)
    diff = (got.float() - expected.float()).abs().max().item()
    return Verification(
        tokens=len(ids),
        max_diff=diff,
        bound=BOUNDS.get(expected.dtype, 1e-5),
        dtype=str(expected.dtype).removeprefix("torch."),
        loader="peft AutoPeftModelForCausalLM" if adapter else "transformers AutoModelForCausalLM",
        versions=done.stdout.strip().splitlines()[-1],
    )


def _fresh_process(folder: str, ids_file: str, out: str, kind: str, *flags: str) -> None:
    """The fresh process's side: load with the Hub libraries only, as a user of the folder would."""
    import transformers
    from safetensors.torch import save_file

    trust = "trust-remote-code" in flags
    if kind == "adapter":
        import peft

        model = peft.AutoPeftModelForCausalLM.from_pretrained(folder, dtype="auto", trust_remote_code=trust)
        versions = f"transformers {transformers.__version__}, peft {peft.__version__}"
    else:
        # A vision-language model's folder (its config has a vision_config) loads as one, as its users load it.
        config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust)
        vision = getattr(config, "vision_config", None) is not None
        auto = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
        model = auto.from_pretrained(folder, dtype="auto", trust_remote_code=trust)
        versions = f"transformers {transformers.__version__}"
    logits = logits_of(model, json.loads(Path(ids_file).read_text()))
    save_file({"logits": logits.contiguous()}, out)
    print(versions)


if __name__ == "__main__":
    _fresh_process(*sys.argv[1:])
