"""The loss module of a run with a preference stage: `models.loss.CausalLMLoss` (the SFT loss,
unchanged) that, while a preference objective is set, returns that objective's loss components.

The engine wraps this one module for the whole run (DDP, FSDP2, DeepSpeed), so an SFT stage and a
DPO stage train the same wrapped parameters; `trainer.objectives.StageObjectives` sets the stage's
objective (`start_stage`) when a stage starts, and nothing else sets state on it. In a
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

from scaletune.models.loss import CausalLMLoss, target_index
from scaletune.objectives.distill import chunked_divergence, teacher_logprobs
from scaletune.objectives.logprobs import sequence_logps, target_logps, target_states
from scaletune.objectives.objective import Objective

__all__ = ["PreferenceLoss", "kl_inputs", "label_columns", "preference_inputs"]

_ROWS = ("input_ids", "labels", "attention_mask", "position_ids")


def preference_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`objectives.module.PreferenceLoss.forward`'s inputs: the rows, precomputed reference
    log-probs (KTO: of its completion rows only), KTO's labels and its step's reference point ``kl``
    (a float the KL pass put in the micro-batch, `trainer.batches.kto_kl_pass`); an online
    objective's ``advantages`` [R] (one per completion row, `rollout`), ``engine_logps`` [R, T]
    (the log-prob each completion token was sampled at, in its label's column) and, for a step
    after a generation's first, ``old_logps`` [R, T] (the trainer's at sampling, same layout)."""
    out = {k: batch[k] for k in _ROWS}
    if "ref_logps" in batch:
        ref = batch["ref_logps"]
        out["ref_logps"] = ref[: batch["input_ids"].size(0)]
    for key in ("desirable", "kl", "advantages", "engine_logps", "old_logps"):
        if key in batch:
            out[key] = batch[key]
    return out


def kl_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """KTO's mismatched KL rows as forward inputs (with their precomputed reference log-probs)."""
    out = {k: batch[f"kl_{k}"] for k in _ROWS}
    if "ref_logps" in batch:
        out["ref_logps"] = batch["ref_logps"][batch["input_ids"].size(0) :]
    return out


class PreferenceLoss(CausalLMLoss):
    """forward(input_ids [R,T], labels [R,T], attention_mask, position_ids, ref_logps [R] | None,
    desirable [m] | None, kl float | None, output) -> what `output` names:

    - ``"loss"``: the objective's loss components [k] (float32 sums over the micro-batch); with no
      objective set, `CausalLMLoss.forward` (the summed token loss);
    - ``"logps"``: the policy's per-row summed log-probs [R] without grad (`reference.precompute`);
    - ``"kl"``: KTO's KL sums [2] without grad: sum over the rows of (policy - reference) log-probs,
      and the row count (`trainer.batches.kto_kl_pass`);
    - ``"token_logps"``: an online objective's per-token log-probs of the completion rows [R, T]
      without grad, each in its label's column (0 elsewhere): the old log-probs of a generation
      trained over several steps (`rollout.Rollout.generate`).

    `output` is an argument, not a method, because every engine gathers sharded parameters inside
    the wrapped module's forward (FSDP2's root unit, ZeRO-3's fetch trace): each pass enters there.
    The stage's objective comes from `start_stage`, its reference mode from its settings
    (base | precomputed | model). After each loss forward `last_stats` holds the objective's
    detached stats sums, which the step adds up.
    """

    def __init__(self, causal_lm: nn.Module, **kwargs: Any) -> None:
        super().__init__(causal_lm, **kwargs)
        self.objective: Objective | None = None
        self.last_stats: torch.Tensor | None = None
        self._reference: list[nn.Module] = []  # a list: not a registered submodule

    def start_stage(self, objective: Objective | None) -> None:
        """The objective the stage trains (None: SFT)."""
        self.objective = objective

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

    def _target_logps(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Per-token log-probs of the distribution sampled from: at the sampling temperature, on its
        top_p nucleus (`target_logps`)."""
        assert self.objective is not None
        return target_logps(
            model,
            inputs["input_ids"],
            inputs["labels"],
            inputs.get("attention_mask"),
            inputs.get("position_ids"),
            partitioned_head=self.partitioned_head,
            chunk=self.chunk,
            temperature=self.objective.settings.temperature,
            top_p=self.objective.settings.top_p,
        )

    def _per_token_loss(
        self,
        inputs: dict[str, torch.Tensor],
        advantages: torch.Tensor | None,
        engine_logps: torch.Tensor | None,
        old_logps: torch.Tensor | None,
    ) -> torch.Tensor:
        """An online objective's loss (GRPO): per-token log-probs of the completion rows, the
        reference's first (no grad) when its KL is weighted. `engine_logps` and `old_logps` [R, T]
        (or None): the engine's, and the sampling policy's as the trainer computed them, log-prob of
        each label, given to the objective in the trainer's token order."""
        assert self.objective is not None and advantages is not None, (
            "a rollout gives every completion row its advantage"
        )
        ref = None
        if self.objective.uses_reference:
            with torch.no_grad():
                ref = self._reference_call(inputs, lambda lm, x: self._target_logps(lm, x)[0])
        logp, rows, _ = self._target_logps(self.causal_lm, inputs)
        batch = {"input_ids": inputs["input_ids"], "labels": inputs["labels"], "advantages": advantages}
        at = target_index(inputs["labels"])  # target_logps' order: the trained positions, row-major
        for key, columns in (("engine_logps", engine_logps), ("old_logps", old_logps)):
            if columns is not None:
                batch[key] = columns[:, 1:].reshape(-1).index_select(0, at.to(columns.device))
        components, stats = self.objective.loss(logp, rows, ref, batch)
        self.last_stats = stats
        return components.to(inputs["input_ids"].device)

    def _distill_loss(self, inputs: dict[str, torch.Tensor], index: torch.Tensor) -> torch.Tensor:
        """Distillation's loss (`objectives.distill`): the teacher's log-probs of every target
        position first (no grad, inside the frozen model's engine-wrapped forward), then the
        student's divergence from them, chunk by chunk."""
        assert self.objective is not None
        settings = self.objective.settings

        def teacher(lm: nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
            states, head = target_states(lm, x["input_ids"], index, x.get("attention_mask"), x.get("position_ids"))
            return teacher_logprobs(states, head, settings.temperature, self.chunk, partitioned=self.partitioned_head)

        with torch.no_grad():
            teacher_logp = self._reference_call(inputs, teacher)
        states, head = target_states(
            self.causal_lm, inputs["input_ids"], index, inputs.get("attention_mask"), inputs.get("position_ids")
        )
        targets = inputs["labels"][:, 1:].reshape(-1).index_select(0, index.to(inputs["labels"].device))
        terms = chunked_divergence(
            states,
            head,
            teacher_logp,
            targets,
            settings.mixture_beta,
            settings.temperature,
            self.chunk,
            partitioned=self.partitioned_head,
        )
        teacher_nll = -teacher_logp.gather(1, targets.to(teacher_logp.device)[:, None]).squeeze(1)
        components, stats = self.objective.loss(terms, None, teacher_nll, {"labels": inputs["labels"]})
        self.last_stats = stats
        return components.to(inputs["input_ids"].device)

    def _reference_call(self, inputs: dict[str, torch.Tensor], fn: Any) -> torch.Tensor:
        """`fn(model, inputs)` on the reference (`model` or `base`; no grad)."""
        assert self.objective is not None
        mode = self.objective.settings.reference
        if mode == "model":
            assert self.reference is not None, "reference: model, but no reference model was set"
            return self.reference(lambda lm: fn(lm, inputs))
        assert mode == "base", f"reference {mode}: not decided (resolve decides auto)"
        disable = getattr(self.causal_lm, "disable_adapter", None)
        assert disable is not None, "reference: base needs a peft model (model.lora)"
        with disable():
            return fn(self.causal_lm, inputs)

    def _reference_logps(self, inputs: dict[str, torch.Tensor], given: torch.Tensor | None) -> torch.Tensor | None:
        assert self.objective is not None
        if not self.objective.uses_reference:
            return None
        mode = self.objective.settings.reference
        assert mode in ("precomputed", "model", "base"), f"reference {mode}: not decided (resolve decides auto)"
        if mode == "precomputed":
            assert given is not None, "reference: precomputed, but the batch carries no ref_logps"
            return given.to(inputs["input_ids"].device, torch.float32)
        with torch.no_grad():
            # `model`: `strategies.reference.FrozenReference` runs fn inside its (engine-wrapped) forward.
            return self._reference_call(inputs, lambda lm, x: self._logps(lm, x)[0])

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        target_index: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        ref_logps: torch.Tensor | None = None,
        desirable: torch.Tensor | None = None,
        kl: float | None = None,
        advantages: torch.Tensor | None = None,
        engine_logps: torch.Tensor | None = None,
        old_logps: torch.Tensor | None = None,
        output: str = "loss",
    ) -> torch.Tensor:
        if self.objective is None:
            assert output == "loss", f"output {output} without a preference objective"
            assert target_index is not None
            return super().forward(input_ids, labels, target_index, attention_mask, position_ids)
        inputs = {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        }
        if self.objective.per_token:
            if output == "token_logps":
                with torch.no_grad():
                    logp, _, _ = self._target_logps(self.causal_lm, inputs)
                return label_columns(logp, labels)
            assert output == "loss", f"output {output} of a per-token objective"
            return self._per_token_loss(inputs, advantages, engine_logps, old_logps)
        if self.objective.distills:
            assert output == "loss" and target_index is not None, f"output {output} of distillation"
            return self._distill_loss(inputs, target_index)
        if output == "logps":
            with torch.no_grad():
                return self._logps(self.causal_lm, inputs)[0]
        ref = self._reference_logps(inputs, ref_logps)
        if output == "kl":
            with torch.no_grad():
                logp = self._logps(self.causal_lm, inputs)[0]
            return torch.stack([(logp - ref).sum(), torch.tensor(float(logp.numel()), device=logp.device)])
        logp, tokens = self._logps(self.causal_lm, inputs)
        assert output == "loss", output
        batch = {"input_ids": input_ids, "labels": labels, "desirable": desirable, "kl": kl}
        components, stats = self.objective.loss(logp, tokens, ref, batch)
        self.last_stats = stats
        return components.to(input_ids.device)


def label_columns(values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token values in `target_logps`' order ([n], the trained positions row-major) as [R, T],
    each in its label's column (the token it scores), 0 elsewhere: the layout ``engine_logps`` and
    ``old_logps`` travel in."""
    rows, width = labels.shape
    flat = torch.zeros(rows * (width - 1), dtype=values.dtype, device=values.device)
    flat.index_copy_(0, target_index(labels).to(values.device), values)
    return torch.cat([torch.zeros(rows, 1, dtype=values.dtype, device=values.device), flat.view(rows, width - 1)], 1)
