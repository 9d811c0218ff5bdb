"""Each preference objective as one small object: how a micro-batch is counted (the units its loss
is averaged over, summed over the global batch before dividing, as the SFT loss is over tokens), its
loss components from the policy's and the reference's per-sequence log-probs, and its metrics.

The step divides component k of every micro-batch by the global sum of unit k, so the loss of a step
is the same computation on 1 or 64 ranks and with any micro-batch split: DPO, IPO, SimPO and the
odds-ratio term of ORPO average over pairs, ORPO's NLL over the chosen answers' trained tokens (the
answer only, as the SFT loss and TRL's `CPOTrainer.nll_loss`; TRL's `ORPOTrainer` also counts the
prompt's tokens), KTO over records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from scaletune.config.preference import OBJECTIVES as FACTS
from scaletune.config.preference import ObjectiveFacts, PreferenceConfig
from scaletune.objectives import losses

__all__ = ["OBJECTIVES", "Objective"]


@dataclass(frozen=True)
class Objective:
    """A preference loss over pairs (``input_ids`` rows: m chosen, then m rejected).

    `loss` gets the policy's (logp [2m], tokens [2m]) and the reference's logp [2m] (None when the
    objective has none) and returns (components [k] float32, the summed loss of the micro-batch per
    unit kind; stats [5] float64, detached: pairs, reward-correct pairs, reward margin sum, chosen
    logp sum, rejected logp sum). What the rest of the run knows about it (data format, units,
    reference, metrics) is its row of `config.preference.OBJECTIVES`, `facts`.
    """

    name: ClassVar[str]
    #: Each step first runs a no-grad pass over the KL rows of the global batch (KTO's reference
    #: point, `trainer.batches.kto_kl_pass`), whose value every micro-batch's loss reads as ``kl``.
    kl_pass: ClassVar[bool] = False
    #: `loss` gets per-token log-probs [n] and their rows [n] (`logprobs.target_logps`) instead of
    #: per-row sums (online objectives, `objectives.rl.GRPO`).
    per_token: ClassVar[bool] = False
    #: The loss module hands `loss` per-token divergences from a teacher (`objectives.distill.Distill`).
    distills: ClassVar[bool] = False
    settings: PreferenceConfig

    @property
    def uses_reference(self) -> bool:
        """Its loss reads a reference model's log-probs."""
        return self.facts.reference

    @property
    def facts(self) -> ObjectiveFacts:
        return FACTS[self.name]

    def units(self, batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
        """This micro-batch's count of each unit the loss components are averaged over."""
        return (batch["input_ids"].size(0) // 2,)

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = t.size(0) // 2
        return t[:m], t[m:]

    def rewards(self, logp, tokens, ref) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) implicit rewards: beta * (policy - reference) summed log-probs."""
        beta = self.settings.beta
        return self.split(beta * (logp.detach() - ref.detach()))

    def stats(self, logp, tokens, ref) -> torch.Tensor:
        chosen_r, rejected_r = self.rewards(logp, tokens, ref)
        chosen, rejected = self.split(logp.detach())
        return torch.stack(
            [
                torch.tensor(float(chosen.numel()), device=logp.device),
                (chosen_r > rejected_r).sum().float(),
                (chosen_r - rejected_r).sum(),
                chosen.sum(),
                rejected.sum(),
            ]
        ).double()

    def loss(self, logp, tokens, ref, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch`: ``input_ids``, ``labels``, ``desirable`` (KTO) and ``kl`` (KTO: the step's
        reference point, a float)."""
        raise NotImplementedError

    #: metrics.jsonl keys (without the eval_ prefix), from the global stats sums.
    def metrics(self, stats: list[float]) -> dict[str, float]:
        pairs = max(stats[0], 1.0)
        return {
            "reward_accuracy": stats[1] / pairs,
            "reward_margin": stats[2] / pairs,
            "logp_chosen": stats[3] / pairs,
            "logp_rejected": stats[4] / pairs,
        }


class DPO(Objective):
    """Direct preference optimisation (Rafailov et al. 2023): `losses.dpo`."""

    name = "dpo"

    def loss(self, logp, tokens, ref, batch):
        pc, pr = self.split(logp)
        rc, rr = self.split(ref)
        s = self.settings
        per_pair = losses.dpo(pc, pr, rc, rr, beta=s.beta, label_smoothing=s.label_smoothing)
        return torch.stack([per_pair.sum()]), self.stats(logp, tokens, ref)


class IPO(Objective):
    """Identity preference optimisation (Azar et al. 2023), TRL's per-token form: `losses.ipo`."""

    name = "ipo"

    def loss(self, logp, tokens, ref, batch):
        pc, pr = self.split(logp)
        rc, rr = self.split(ref)
        tc, tr = self.split(tokens)
        per_pair = losses.ipo(pc, pr, rc, rr, tc, tr, beta=self.settings.beta)
        return torch.stack([per_pair.sum()]), self.stats(logp, tokens, ref)


class SimPO(Objective):
    """Simple preference optimisation (Meng et al. 2024), no reference: `losses.simpo`. Rewards are
    beta times the average log-prob per completion token (as TRL's CPOTrainer logs them)."""

    name = "simpo"

    def rewards(self, logp, tokens, ref):
        return self.split(self.settings.beta * logp.detach() / tokens.clamp(min=1))

    def loss(self, logp, tokens, ref, batch):
        pc, pr = self.split(logp)
        tc, tr = self.split(tokens)
        s = self.settings
        per_pair = losses.simpo(pc, pr, tc, tr, beta=s.beta, gamma=s.gamma, label_smoothing=s.label_smoothing)
        return torch.stack([per_pair.sum()]), self.stats(logp, tokens, ref)


class ORPO(SimPO):
    """Odds-ratio preference optimisation (Hong et al. 2024), no reference: the chosen answers' NLL
    (averaged over their tokens in the global batch) plus `losses.orpo_odds_ratio` (over pairs)."""

    name = "orpo"

    def units(self, batch):
        m = batch["input_ids"].size(0) // 2
        chosen_targets = int((batch["labels"][:m, 1:] != -100).sum())
        return (chosen_targets, m)

    def loss(self, logp, tokens, ref, batch):
        pc, pr = self.split(logp)
        tc, tr = self.split(tokens)
        ratio = losses.orpo_odds_ratio(pc, pr, tc, tr, beta=self.settings.beta)
        return torch.stack([-pc.sum(), ratio.sum()]), self.stats(logp, tokens, ref)


class KTO(Objective):
    """Kahneman-Tversky optimisation (Ethayarajh et al. 2024): `losses.kto` on unpaired records
    (``input_ids`` rows: m completions; ``desirable`` [m]), with the reference point `kl` measured on
    the mismatched KL rows of the whole global batch before the step (`kl` set by the step's KL pass).

    Stats: desirable count, undesirable count, desirable reward sum, undesirable reward sum,
    desirable logp sum, undesirable logp sum, kl (the last is not summed: the step's value).
    """

    name = "kto"
    kl_pass: ClassVar[bool] = True

    def units(self, batch):
        return (batch["input_ids"].size(0),)

    def stats(self, logp, tokens, ref, desirable=None, kl=None) -> torch.Tensor:
        d = desirable.bool()
        reward = self.settings.beta * (logp.detach() - ref.detach())
        lp = logp.detach()
        zero = torch.zeros((), device=logp.device)
        return torch.stack(
            [
                d.sum().float(),
                (~d).sum().float(),
                torch.where(d, reward, zero).sum(),
                torch.where(~d, reward, zero).sum(),
                torch.where(d, lp, zero).sum(),
                torch.where(~d, lp, zero).sum(),
            ]
        ).double()

    def loss(self, logp, tokens, ref, batch):
        s = self.settings
        assert batch.get("kl") is not None, "KTO's KL pass did not run before the loss"
        per = losses.kto(
            logp,
            ref,
            batch["desirable"],
            torch.tensor(batch["kl"], dtype=torch.float32, device=logp.device),
            beta=s.beta,
            desirable_weight=s.desirable_weight,
            undesirable_weight=s.undesirable_weight,
        )
        return torch.stack([per.sum()]), self.stats(logp, tokens, ref, batch["desirable"])

    def metrics(self, stats: list[float]) -> dict[str, float]:
        nd, nu = max(stats[0], 1.0), max(stats[1], 1.0)
        return {
            "reward_margin": stats[2] / nd - stats[3] / nu,
            "logp_chosen": stats[4] / nd,
            "logp_rejected": stats[5] / nu,
        }


#: The preference objectives (GRPO, online, is `objectives.rl`; `objectives.table` holds both).
OBJECTIVES: dict[str, type[Objective]] = {o.name: o for o in (DPO, IPO, SimPO, ORPO, KTO)}
