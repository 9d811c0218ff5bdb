"""GRPO and its variants (objective `grpo`, `training.rl`): group-relative advantages and the clipped
policy loss over the completions' tokens, with an optional KL to the reference model.

The formulas are TRL 1.16's `GRPOTrainer` (`_compute_loss`, `_generate_and_score_completions`), so a
step equals TRL's on the same tokens: advantages ``(r - mean_G) / (std_G + 1e-4)`` with the group's
Bessel-corrected std (mean only for dr_grpo); ratio ``exp(logp - logp_old)`` clipped to
``[1 - low, 1 + high]``; per-token loss ``-min(ratio * A, clip(ratio) * A) + beta * ratio * kl`` with the k3
estimator ``kl = exp(ref - logp) - (ref - logp) - 1`` (Schulman 2020) weighted by the ratio, its
gradient kept (DeepSeek-V3.2, arXiv 2512.02556; TRL's `use_bias_correction_kl`). How per-token losses average
is the variant (`config.rl.RLConfig.loss`); the step divides by the global count of its unit, so a
step is the same on 1 or 64 ranks (TRL normalises dapo globally, grpo and dr_grpo per micro-batch).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from scaletune.config.rl import RLConfig
from scaletune.objectives.objective import Objective

__all__ = ["GRPO", "ADVANTAGE_EPS", "group_advantages", "policy_token_loss"]

#: TRL's epsilon in ``(r - mean) / (std + eps)``.
ADVANTAGE_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, group: int, scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage within its group.

    Args:
        rewards: [n * group] float total rewards, the `group` completions of a prompt adjacent.
        group: completions per prompt (`num_generations`).
        scale: divide by the group's std (+ `ADVANTAGE_EPS`); False: mean only (Dr. GRPO).

    Returns:
        (advantages [n * group] float32, std [n] float32: each group's Bessel-corrected std).
    """
    r = rewards.float().view(-1, group)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True)  # correction=1, as TRL's nanstd
    adv = r - mean
    if scale:
        adv = adv / (std + ADVANTAGE_EPS)
    return adv.reshape(-1), std.reshape(-1)


def policy_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip: tuple[float, float],
    beta: float = 0.0,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clipped surrogate per token (PPO, Schulman et al. 2017; two-sided as DAPO's clip-higher),
    plus the KL to the reference weighted by the ratio (DeepSeek-V3.2's unbiased KL estimate, TRL
    1.16's `use_bias_correction_kl`, its default).

    Args:
        logp: [n] the policy's log-probs of the completion tokens (with grad).
        old_logp: [n] the sampling policy's (no grad; equal to `logp` when each generation trains one step).
        advantages: [n] each token's completion's advantage.
        clip: (low, high).
        beta: KL weight; `ref_logp` [n] is read when > 0.

    Returns:
        (loss [n], clipped [n] bool: a ratio clipped where it matters, as TRL's clip_ratio/region,
        kl [n]: the k3 estimate, zeros when beta is 0).
    """
    low, high = clip
    ratio = torch.exp(logp - old_logp)
    clipped_ratio = torch.clamp(ratio, 1 - low, 1 + high)
    loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    if beta:
        assert ref_logp is not None, "beta > 0 needs the reference's log-probs"
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
        # Weighted by the ratio, gradient included: E_old[ratio * kl] is the KL of the policy, and its
        # gradient the reverse KL's whole gradient (k3's own and kl * grad logp), also at ratio 1.
        loss = loss + beta * kl * ratio
    else:
        kl = torch.zeros_like(logp)
    with torch.no_grad():
        clipped = ((ratio < 1 - low) & (advantages < 0)) | ((ratio > 1 + high) & (advantages > 0))
    return loss, clipped, kl.detach()


class GRPO(Objective):
    """Group relative policy optimisation over the completion rows a rollout built
    (`rollout.rows`): `loss` gets per-token log-probs, not per-row sums (`per_token`).

    Units (the step's denominator): dapo: completion tokens; grpo: completions (each contributes its
    per-token mean); dr_grpo: completions * max_new_tokens. Stats [6], float64 sums: completions,
    completion tokens, clipped tokens, KL sum over tokens, |trainer - engine| log-prob sum over the
    tokens the engine gave log-probs for (the trainer's at sampling: the old log-probs where a
    generation trains several steps), and those tokens.
    """

    name = "grpo"
    per_token: ClassVar[bool] = True
    settings: RLConfig  # type: ignore[assignment]

    @property
    def uses_reference(self) -> bool:
        return self.settings.beta > 0

    def units(self, batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
        rows = batch["input_ids"].size(0)
        if self.settings.loss == "dapo":
            return (int((batch["labels"][:, 1:] != -100).sum()),)
        if self.settings.loss == "dr_grpo":
            return (rows * self.settings.max_new_tokens,)
        return (rows,)

    def loss(self, logp, tokens, ref, batch):
        """`logp` [n] per-token log-probs, `tokens` [n] their rows, `ref` [n] or None; `batch`:
        ``input_ids`` [R, T], ``advantages`` [R], ``engine_logps`` [n] where the engine gave them,
        and ``old_logps`` [n] (the sampling policy's) on a step after its generation's first (else
        the policy is the sampling policy: ``logp`` detached, ratio 1)."""
        rows = tokens
        adv = batch["advantages"].to(logp.device, torch.float32)[rows]
        s = self.settings
        old = batch.get("old_logps")
        old = logp.detach() if old is None else old.to(logp.device, torch.float32)
        per_token, clipped, kl = policy_token_loss(logp, old, adv, s.clip, s.beta, ref)
        n_rows = batch["input_ids"].size(0)
        if s.loss == "grpo":
            counts = torch.zeros(n_rows, device=logp.device).index_add_(0, rows, torch.ones_like(per_token))
            sums = torch.zeros(n_rows, device=logp.device).index_add(0, rows, per_token)
            component = (sums / counts.clamp(min=1)).sum()
        else:
            component = per_token.sum()
        stats = torch.stack(
            [
                torch.tensor(float(n_rows), device=logp.device),
                torch.tensor(float(per_token.numel()), device=logp.device),
                clipped.sum().float(),
                kl.sum(),
                *_mismatch(old, batch.get("engine_logps")),
            ]
        ).double()
        return torch.stack([component]), stats

    def metrics(self, stats: list[float]) -> dict[str, float]:
        tokens = max(stats[1], 1.0)
        out = {"clip_fraction": stats[2] / tokens}
        if self.settings.beta > 0:
            out["kl"] = stats[3] / tokens
        if stats[5]:
            out["logp_mismatch"] = stats[4] / stats[5]
        return out


def _mismatch(logp: torch.Tensor, engine: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of |logp - engine| over the tokens, their count) as float32 scalars; zeros without
    engine log-probs. The mean is the step's ``logp_mismatch``: the nats a token by which the
    trainer's log-probs differ from those the engine sampled at."""
    if engine is None:
        zero = torch.zeros((), device=logp.device)
        return zero, zero
    diff = (logp.float() - engine.to(logp.device, torch.float32)).abs()
    return diff.sum(), torch.tensor(float(diff.numel()), device=logp.device)
