"""The preference losses as pure formulas over per-sequence log-probabilities.

Each function takes log-probabilities *summed* over a completion's trained tokens (and, where the
method normalises by length, the completion's token counts) and returns the loss of each example,
unreduced: the caller sums over its micro-batch and divides by the global count (pairs, or KTO
examples), so gradient accumulation and world size do not change the loss. Everything is computed in
float32 whatever the inputs' dtype. Nothing here raises on its own; mismatched shapes fail in torch's
broadcasting.

Each docstring names the paper and the TRL 1.16 code it matches (``tests/objectives/test_losses.py``
and ``tests/e2e/test_preference_vs_trl.py`` hold them to it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation: log1p(-exp(x)) below -ln 2, log(-expm1(x))
    above it (Mächler 2012). x == 0 (a completion of probability 1) gives -inf, as the formula does."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def dpo(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> Tensor:
    """DPO (Rafailov et al. 2023, arXiv:2305.18290, eq. 7) with conservative label smoothing (cDPO,
    Mitchell 2023): with ``d = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)``,
    ``-(1 - ls) * logsigmoid(beta * d) - ls * logsigmoid(-beta * d)``; ``ls = 0`` is the paper's loss.

    TRL 1.16: ``DPOTrainer._compute_loss`` with ``loss_type="sigmoid"`` computes
    ``-logsigmoid(beta * delta_score)`` and no longer applies ``label_smoothing`` there (it does in
    ``"robust"`` and ``"aot"``); smoothing 0 matches it, and the smoothed form is the one TRL's
    ``CPOTrainer.cpo_loss`` (``loss_type="sigmoid"``) and older TRL DPO used. Returns [m]."""
    d = (policy_chosen.float() - ref_chosen.float()) - (policy_rejected.float() - ref_rejected.float())
    loss = -F.logsigmoid(beta * d)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-beta * d)
    return loss


def ipo(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    *,
    beta: float,
) -> Tensor:
    """IPO (Azar et al. 2023, arXiv:2310.12036, eq. 17, beta playing tau) in TRL's per-token form:
    each log-ratio is divided by its completion's token count (at least 1), then
    ``(chosen_avg - rejected_avg - 1 / (2 * beta)) ** 2``. The minimum is at a per-token margin of
    ``1 / (2 * beta)``. TRL 1.16: ``DPOTrainer._compute_loss``, ``loss_type="ipo"`` (the length
    normalisation is TRL's, confirmed there with the paper's authors). Returns [m]."""
    chosen = (policy_chosen.float() - ref_chosen.float()) / chosen_tokens.float().clamp(min=1.0)
    rejected = (policy_rejected.float() - ref_rejected.float()) / rejected_tokens.float().clamp(min=1.0)
    return (chosen - rejected - 1 / (2 * beta)) ** 2


def simpo(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    *,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> Tensor:
    """SimPO (Meng et al. 2024, arXiv:2405.14734, eq. 6): no reference; the reward is beta times the
    average log-prob per completion token, and with ``z = beta * (chosen_avg - rejected_avg) - gamma``
    the loss is ``-(1 - ls) * logsigmoid(z) - ls * logsigmoid(-z)``. TRL 1.16:
    ``trl.experimental.cpo.CPOTrainer.cpo_loss`` with ``loss_type="simpo"`` (``simpo_gamma`` =
    gamma, ``cpo_alpha=0``: no NLL term), which divides by the token count unclamped; so does this.
    Returns [m]."""
    chosen = policy_chosen.float() / chosen_tokens.float()
    rejected = policy_rejected.float() / rejected_tokens.float()
    z = beta * (chosen - rejected) - gamma
    loss = -F.logsigmoid(z)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-z)
    return loss


def orpo_odds_ratio(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    *,
    beta: float,
) -> Tensor:
    """ORPO's odds-ratio term (Hong et al. 2024, arXiv:2403.07691, eqs. 4-7), the part ADDED to the
    chosen completion's NLL: with average log-probs ``a = logp / tokens``,
    ``log_odds = (a_c - a_r) - (log(1 - exp(a_c)) - log(1 - exp(a_r)))`` and the term is
    ``-beta * logsigmoid(log_odds)`` (beta is the paper's lambda). TRL 1.16:
    ``trl.experimental.orpo.ORPOTrainer.odds_ratio_loss``, which returns ``beta * logsigmoid`` and
    subtracts its mean from the NLL. Returns [m]."""
    chosen = policy_chosen.float() / chosen_tokens.float()
    rejected = policy_rejected.float() / rejected_tokens.float()
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    return -beta * F.logsigmoid(log_odds)


def kto(
    policy: Tensor,
    reference: Tensor,
    desirable: Tensor,
    kl: Tensor,
    *,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> Tensor:
    """KTO (Ethayarajh et al. 2024, arXiv:2402.01306, eqs. 7-8): with ``r = policy - reference``
    (summed log-probs) and the reference point ``kl`` (0-dim, detached, already clamped at 0),
    a desirable example's loss is ``desirable_weight * (1 - sigmoid(beta * (r - kl)))`` and an
    undesirable one's ``undesirable_weight * (1 - sigmoid(beta * (kl - r)))``. ``desirable`` is a
    bool [n]. TRL 1.16: ``KTOTrainer._compute_loss``, ``loss_type="kto"`` (which concatenates the
    desirable then the undesirable losses and takes their mean; here they stay in input order).
    Returns [n]."""
    r = policy.float() - reference.float()
    kl = kl.float()
    return torch.where(
        desirable.bool(),
        desirable_weight * (1 - torch.sigmoid(beta * (r - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - r))),
    )
