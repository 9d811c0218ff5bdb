"""An inference runtime's own greedy continuation of the probe, scored by transformers: the check
`scaletune export --verify` makes of a GGUF file in llama.cpp (`checkpoint.verify_gguf`) and of a
model folder in vLLM (`checkpoint.verify_vllm`).

The runtime, in a fresh process, continues the probe's first :data:`PROMPT_TOKENS` tokens greedily
by :data:`NEW_TOKENS`, with the log-probability it gives each token it chose; transformers scores
the same tokens, teacher-forced, on the model the export holds in float32. Two checks, on each
chosen token:

- the runtime's log-probability equals transformers' within a bound that is a fraction of the spread
  of transformers' logits there (their standard deviation over the vocabulary, the mean over the
  scored positions): a weight's rounding moves log-probabilities in proportion to the logits' scale,
  so a bound in nats alone would be loose for a tiny model's near-flat logits and tight for a
  trained one's; a wrong layout or tensor moves them by whole nats;
- where transformers' choice is decisive (its best token leads the next by more than twice the
  bound), the runtime chose the same token; a near tie may fall either way under rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: Tokens the runtime continues the probe by.
NEW_TOKENS = 8
#: The probe's first tokens, the prompt the runtime continues (`verify.probe_ids`' text).
PROMPT_TOKENS = 16


@dataclass(frozen=True)
class ContinuationCheck:
    """The result: `runtime` (with its version) loaded `subject` and chose `tokens` tokens after a
    `prompt`-token probe; the largest |log-probability difference| `max_diff` against `bound` (nats:
    `fraction` times the logits' spread `scale`, the fraction for `weights`), the positions where
    transformers' choice was decisive (`decisive`) and how many of those the runtime chose alike
    (`agreed`). `reference` names what transformers scored."""

    subject: str
    runtime: str
    reference: str
    weights: str
    fraction: float
    prompt: int
    tokens: int
    max_diff: float
    bound: float
    scale: float
    decisive: int
    agreed: int

    @property
    def passed(self) -> bool:
        return self.max_diff <= self.bound and self.agreed == self.decisive

    def sentence(self) -> str:
        """One line: what was loaded how, and the differences against their bounds."""
        verdict = "passed" if self.passed else "FAILED"
        return (
            f"export --verify {verdict}: {self.subject}, loaded in a fresh process by {self.runtime}, "
            f"continued a {self.prompt}-token probe greedily by {self.tokens} tokens whose log-probabilities are "
            f"within {self.max_diff:.3g} nats of transformers' on {self.reference} (bound {self.bound:.3g}: "
            f"{self.fraction:g} of its logits' spread {self.scale:.3g} for {self.weights}); it chose "
            f"transformers' token at {self.agreed} of the {self.decisive} positions where that choice was decisive"
        )

    def failure(self) -> str:
        """What failed, for the refusal: the sentence, which says it."""
        return self.sentence()


def prompt_ids(tokenizer: Any) -> list[int]:
    """The prompt the runtime continues: the probe's first :data:`PROMPT_TOKENS` token ids."""
    from scaletune.checkpoint.verify import probe_ids

    return probe_ids(tokenizer)[:PROMPT_TOKENS]


def fresh_answer(
    argv: list[str], out: Path, what: str, *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run the runtime's fresh process (`argv`, no shell) to its end and read its answer, the JSON
    file `out` it writes (``tokens``, ``logprobs``, ``versions``).

    Raises:
        RuntimeError: it exited non-zero, or wrote no answer: `what` ("x.gguf did not load or run in
            llama.cpp") and its last lines of stderr.
    """
    done = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"--verify: {what}:\n{tail}")
    if not out.is_file():
        raise RuntimeError(f"--verify: {what}: it wrote no answer")
    return json.loads(out.read_text())


@torch.no_grad()
def score(
    model: torch.nn.Module, prompt: list[int], answer: dict[str, Any], fraction: float, **names: str
) -> ContinuationCheck:
    """Score the runtime's `answer` (its chosen ``tokens`` after `prompt`, their ``logprobs``, its
    ``versions``) with `model`, teacher-forced in float64 log-softmax.

    Args:
        model: the float32 model the export holds (transformers).
        prompt: the token ids the runtime continued.
        fraction: the bound, as a fraction of the logits' spread.
        names: ``subject``, ``runtime`` (the versions are appended), ``reference`` and ``weights``
            of :class:`ContinuationCheck`.
    """
    chosen, theirs = answer["tokens"], torch.tensor(answer["logprobs"], dtype=torch.float64)
    assert chosen and len(chosen) == len(theirs), "the runtime chose no token, or gave no log-probability for one"
    logits = model.eval()(input_ids=torch.tensor([prompt + chosen])).logits[0].double()
    scored = logits[len(prompt) - 1 : len(prompt) - 1 + len(chosen)]  # row k predicts chosen token k
    logps = torch.log_softmax(scored, dim=-1)
    ours = logps[torch.arange(len(chosen)), torch.tensor(chosen)]
    scale = float(scored.std(dim=-1).mean())
    bound = fraction * scale
    top2 = logps.topk(2, dim=-1)
    decisive = (top2.values[:, 0] - top2.values[:, 1]) > 2 * bound
    agreed = decisive & (top2.indices[:, 0] == torch.tensor(chosen))
    return ContinuationCheck(
        subject=names["subject"],
        runtime=f"{names['runtime']} ({answer['versions']})",
        reference=names["reference"],
        weights=names["weights"],
        fraction=fraction,
        prompt=len(prompt),
        tokens=len(chosen),
        max_diff=float((ours - theirs).abs().max()),
        bound=bound,
        scale=scale,
        decisive=int(decisive.sum()),
        agreed=int(agreed.sum()),
    )
