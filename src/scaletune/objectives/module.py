"""The loss module of a run with a preference stage: `models.loss.CausalLMLoss` (the SFT loss,
unchanged) that, while a preference objective is set, returns that objective's loss components.

The engine wraps this one module for the whole run (DDP, FSDP2, DeepSpeed), so an SFT stage and a
DPO stage train the same wrapped parameters; the loop sets `objective` when a stage starts. In a
preference forward the reference's log-probs come first, without grad, then the policy's with grad,
so the last forward before backward is the policy's (FSDP2 and ZeRO-3 prefetch for the backward
of the last forward they saw):

- ``precomputed``: from the batch (``ref_logps``, computed once per stage by `reference.precompute`);
- ``base``: the same model with its LoRA adapters disabled (peft's `disable_adapter`), no copy;
- ``model``: a frozen model the strategy made resident like the policy (`Strategy.wrap_reference`);
  it is held outside the module tree, so no engine counts it as trained.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scaletune.models.loss import CausalLMLoss
from scaletune.objectives.logprobs import sequence_logps
from scaletune.objectives.objective import KTO, Objective

__all__ = ["PreferenceLoss", "kl_inputs", "preference_inputs"]

_ROWS = ("input_ids", "labels", "attention_mask", "position_ids")


def preference_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`objectives.module.PreferenceLoss.forward`'s tensors: the rows, precomputed reference
    log-probs (KTO: of its completion rows only) and KTO's labels."""
    out = {k: batch[k] for k in _ROWS}
    if "ref_logps" in batch:
        ref = batch["ref_logps"]
        out["ref_logps"] = ref[: batch["input_ids"].size(0)]
    if "desirable" in batch:
        out["desirable"] = batch["desirable"]
    return out


def kl_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """KTO's mismatched KL rows as forward inputs (with their precomputed reference log-probs)."""
    out = {k: batch[f"kl_{k}"] for k in _ROWS}
    if "ref_logps" in batch:
        out["ref_logps"] = batch["ref_logps"][batch["input_ids"].size(0) :]
    return out


class PreferenceLoss(CausalLMLoss):
    """forward(input_ids [R,T], labels [R,T], attention_mask, position_ids, ref_logps [R] | None,
    desirable [m] | None) -> the objective's loss components [k] (float32 sums over the micro-batch);
    with no objective set, `CausalLMLoss.forward` (the summed token loss).

    Attributes set by the loop: `objective` (None: SFT), `reference_mode` (base | precomputed |
    model), `pass_kind` ("loss"; "logps": the policy's per-row log-probs without grad, for the
    precompute pass; "kl": KTO's KL sums), `kl` (KTO's reference point for this step). After each
    forward `last_stats` holds the objective's detached stats sums.
    """

    def __init__(self, causal_lm: nn.Module, **kwargs: Any) -> None:
        super().__init__(causal_lm, **kwargs)
        self.objective: Objective | None = None
        self.reference_mode = "precomputed"
        self.pass_kind = "loss"
        self.kl: torch.Tensor | None = None
        self.last_stats: torch.Tensor | None = None
        self._reference: list[nn.Module] = []  # a list: not a registered submodule

    def set_reference(self, model: nn.Module | None) -> None:
        """The frozen reference model of `reference: model` (None: none resident)."""
        self._reference = [model] if model is not None else []

    @property
    def reference(self) -> nn.Module | None:
        return self._reference[0] if self._reference else None

    def _logps(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return sequence_logps(
            model,
            inputs["input_ids"],
            inputs["labels"],
            inputs.get("attention_mask"),
            inputs.get("position_ids"),
            partitioned_head=self.partitioned_head,
            chunk=self.chunk,
        )

    def _reference_logps(self, inputs: dict[str, torch.Tensor], given: torch.Tensor | None) -> torch.Tensor | None:
        assert self.objective is not None
        if not self.objective.uses_reference:
            return None
        if self.reference_mode == "precomputed":
            assert given is not None, "reference: precomputed, but the batch carries no ref_logps"
            return given.to(inputs["input_ids"].device, torch.float32)
        with torch.no_grad():
            if self.reference_mode == "model":
                assert self.reference is not None, "reference: model, but no reference model was set"
                # `strategies.reference.FrozenReference`: fn runs inside its (engine-wrapped) forward.
                return self.reference(lambda lm: self._logps(lm, inputs)[0])
            disable = getattr(self.causal_lm, "disable_adapter", None)
            assert disable is not None, "reference: base needs a peft model (model.lora)"
            with disable():
                return self._logps(self.causal_lm, inputs)[0]

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        target_index: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        ref_logps: torch.Tensor | None = None,
        desirable: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.objective is None:
            assert target_index is not None
            return super().forward(input_ids, labels, target_index, attention_mask, position_ids)
        inputs = {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        }
        if self.pass_kind == "logps":
            with torch.no_grad():
                return self._logps(self.causal_lm, inputs)[0]
        ref = self._reference_logps(inputs, ref_logps)
        if self.pass_kind == "kl":
            with torch.no_grad():
                logp = self._logps(self.causal_lm, inputs)[0]
            return torch.stack([(logp - ref).sum(), torch.tensor(float(logp.numel()), device=logp.device)])
        logp, tokens = self._logps(self.causal_lm, inputs)
        batch = {"input_ids": input_ids, "labels": labels, "desirable": desirable}
        if isinstance(self.objective, KTO):
            assert self.kl is not None, "KTO's KL pass did not run before the loss"
            components, stats = self.objective.loss(logp, tokens, ref, batch, kl=self.kl)
        else:
            components, stats = self.objective.loss(logp, tokens, ref, batch)
        self.last_stats = stats
        return components.to(input_ids.device)
