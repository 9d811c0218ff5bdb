"""Knowledge distillation (objective `distill`, `training.distill`): at every trained token, a
divergence between the teacher's and the student's next-token distributions over the whole
vocabulary, summed over the micro-batch's target tokens; the step divides by the global count of
target tokens, as the SFT loss (so the loss is the same on 1 or 64 ranks).

The divergence is TRL 1.16's `GKDTrainer.generalized_jsd_loss` (Agarwal et al. 2024, On-Policy
Distillation of Language Models, eq. 1): with s, t the student's and teacher's log-softmax at
temperature T, forward KL ``sum_v e^t (t - s)`` (TRL's beta 0), reverse KL ``sum_v e^s (s - t)``
(beta 1), else with ``m = log((1 - beta) e^s + beta e^t)``,
``beta * sum_v e^t (t - m) + (1 - beta) * sum_v e^s (s - m)``. TRL averages over a micro-batch's
tokens ("batchmean"); the sum over tokens divided by the global count is the same for one micro-batch.

Memory: the teacher's log-probs of a micro-batch's targets are held whole ([n, vocab] float32, no
grad); the student's logits exist one chunk at a time, recomputed in the backward.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from scaletune.config.distill import DistillConfig
from scaletune.data import count_target_tokens
from scaletune.objectives.logprobs import over_chunks
from scaletune.objectives.objective import Objective

__all__ = ["Distill", "chunked_divergence", "teacher_logprobs", "token_divergence"]


def token_divergence(student_logits: torch.Tensor, teacher_logp: torch.Tensor, beta: float, temperature: float):
    """The divergence at each position, summed over the vocabulary.

    Args:
        student_logits: [n, vocab] the student's logits (any float dtype; computed in float32).
        teacher_logp: [n, vocab] float32 the teacher's log-softmax at `temperature` (`teacher_logprobs`).
        beta: 0 forward KL, 1 reverse KL, else the generalized JSD's (module docstring).
        temperature: the student's logits are divided by it.

    Returns:
        [n] float32.
    """
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = teacher_logp.to(s.device)
    if beta == 0:
        return F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(t, s, reduction="none", log_target=True).sum(-1)
    m = torch.logsumexp(torch.stack([s + math.log1p(-beta), t + math.log(beta)]), dim=0)
    kl_teacher = F.kl_div(m, t, reduction="none", log_target=True).sum(-1)
    kl_student = F.kl_div(m, s, reduction="none", log_target=True).sum(-1)
    return beta * kl_teacher + (1 - beta) * kl_student


def _chunk_terms(hidden, teacher_logp, targets, head, beta, temperature):
    """[2, c]: the divergence, and the student's negative log-likelihood of the targets at `temperature`."""
    logits = head(hidden) if head is not None else hidden
    nll = F.cross_entropy(logits.float() / temperature, targets.to(logits.device), reduction="none")
    return torch.stack([token_divergence(logits, teacher_logp, beta, temperature), nll])


def _teacher_chunk(hidden, head, temperature):
    logits = head(hidden) if head is not None else hidden
    return F.log_softmax(logits.float() / temperature, dim=-1)


def teacher_logprobs(
    states: torch.Tensor,
    head: nn.Module | None,
    temperature: float,
    chunk: int | None = None,
    partitioned: bool = False,
):
    """The teacher's log-softmax at `temperature` of every target position ([n, vocab] float32, no
    grad), its head run chunk by chunk (`objectives.logprobs.over_chunks`; `partitioned`: called once,
    whatever this rank's count of targets). `states`, `head`: `objectives.logprobs.target_states`."""
    with torch.no_grad():
        return over_chunks(
            _teacher_chunk, (states,), (head, temperature), head=head, chunk=chunk, partitioned=partitioned
        )


def chunked_divergence(
    states: torch.Tensor,
    head: nn.Module | None,
    teacher_logp: torch.Tensor,
    targets: torch.Tensor,
    beta: float,
    temperature: float,
    chunk: int | None = None,
    partitioned: bool = False,
) -> torch.Tensor:
    """:func:`token_divergence` of the student's head over `states` ([n, hidden], or logits where
    `head` is None) against `teacher_logp` [n, vocab], with the student's NLL of `targets` [n], chunk
    by chunk under activation checkpointing (`objectives.logprobs.over_chunks`: only one chunk's
    logits exist at a time; `partitioned`: one call per micro-batch on every rank).

    Returns:
        [2, n] float32: the divergences (with grad), the NLLs.
    """
    return over_chunks(
        _chunk_terms,
        (states, teacher_logp, targets),
        (head, beta, temperature),
        head=head,
        chunk=chunk,
        partitioned=partitioned,
        dim=1,
    )


class Distill(Objective):
    """Offline distillation. `loss` gets the per-token terms [2, n] (`chunked_divergence`: the
    divergences with grad, the student's NLLs) and the teacher's NLLs [n], and returns (components
    [1]: the divergences' sum; stats [4] float64: that sum, the student's and the teacher's NLL
    sums, the target tokens). The step averages over the global target tokens, as SFT's loss."""

    name = "distill"
    #: The loss module computes the per-token terms itself (`objectives.module.PreferenceLoss`).
    distills: ClassVar[bool] = True
    settings: DistillConfig  # type: ignore[assignment]

    def units(self, batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
        return (count_target_tokens(batch["labels"]),)

    def loss(self, logp, tokens, ref, batch):
        terms, teacher_nll = logp, ref
        total = terms[0].sum()
        stats = torch.stack(
            [
                total.detach(),
                terms[1].detach().sum(),
                teacher_nll.sum(),
                torch.tensor(float(terms.size(1)), device=total.device),
            ]
        )
        return torch.stack([total]), stats.double()

    def metrics(self, stats: list[float]) -> dict[str, float]:
        n = max(stats[3], 1.0)
        return {"student_nll": stats[1] / n, "teacher_nll": stats[2] / n}
