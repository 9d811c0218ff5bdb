"""Loss and perplexity of a model on a data set, tokenized and masked exactly as training does
(the data package's encoder and collator, the training loss module); reward accuracy and margins of
preference pairs against a reference model (the preference rows and `objectives.sequence_logps`)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletune.config import Config, DataConfig, DataSource
from scaletune.config.preference import OBJECTIVES
from scaletune.errors import UserError
from scaletune.inference.loading import LoadedModel, Target


def eval_data_config(
    loaded: LoadedModel, path: str, fmt: str | None, max_seq_length: int | None, field: str | None = None
) -> DataConfig:
    """The `data` section that reads `path` as training would: format, alpaca template, chat
    template and max_seq_length default to the run's (else alpaca, the model's prompt format, 1024)."""
    run = loaded.data
    run_src = run.train if run is not None and run.train is not None else None
    fmt = fmt or (run_src.format if run_src else "alpaca")
    template = "chat" if fmt == "alpaca" and loaded.template == "chat" else "alpaca"
    source = DataSource(path=path, format=fmt, template=template, field=field)  # type: ignore[arg-type]
    return DataConfig(
        train=source,
        max_seq_length=max_seq_length or (run.max_seq_length if run is not None else 1024),
        chat_template=loaded.chat_template,
    )


def evaluate(loaded: LoadedModel, data_cfg: DataConfig, *, batch_size: int = 8) -> dict[str, Any]:
    """Mean next-token loss over every trained (unmasked) token of the data set, and its exponential.

    Returns:
        `loss` (nats per target token, the same mean as `eval_loss` in metrics.jsonl), `perplexity`
        (exp of it), `target_tokens`, `examples` (after dropping those left with no target),
        `truncated` (examples cut at max_seq_length).

    Raises:
        DataError: the data cannot be read or leaves nothing to evaluate.
    """
    import torch

    from scaletune.data import Collator, build_datasets, count_target_tokens
    from scaletune.models import max_positions
    from scaletune.models.loss import CausalLMLoss, target_index

    tok = loaded.tokenizer
    # A vision-language model's records are rendered by its processor and collated with their images,
    # as training renders them (data.vision).
    bundle = build_datasets(
        data_cfg, tok, seed=0, max_positions=max_positions(loaded.model), processor=loaded.processor
    )
    rows = bundle.train
    collate = bundle.collator or Collator(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    loss_fn = CausalLMLoss(loaded.model)
    total, targets = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = collate([rows[i] for i in range(start, min(start + batch_size, len(rows)))])
            inputs = {k: v.to(loaded.device) for k, v in batch.items()}
            inputs["target_index"] = target_index(batch["labels"]).to(loaded.device)
            total += float(loss_fn(**inputs))
            targets += count_target_tokens(batch["labels"])
    loss = total / max(targets, 1)
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "target_tokens": targets,
        "examples": len(rows),
        "truncated": bundle.stats.get("truncated", 0),
    }


# -- preference pairs (`--format preference`, issue 24) ---------------------------------------------


@dataclass(frozen=True)
class PreferencePlan:
    """What `eval --format preference` compares: the policy against `reference`.

    Attributes:
        objective: the run's preference objective (its last stage's that has one; `dpo` without a run).
        beta: the rewards' scale.
        reference: "adapter" (the policy's own base: the LoRA adapter disabled), a model to load
            (name, folder or run), or None: no reference (SimPO/ORPO rewards, or log-probs only).
        rewards: "reference" (beta * (logp - reference logp), summed over completion tokens),
            "length" (beta * logp / completion tokens: SimPO, ORPO) or None (a bare model without
            --reference: log-prob margins only).
        max_seq_length, chat_template: those of the run's last preference stage where it sets its
            own (`stages[].data`), else None (the run's top-level `data`).
    """

    objective: str
    beta: float
    reference: str | None
    rewards: str | None
    max_seq_length: int | None = None
    chat_template: str | None = None

    def describe(self) -> str:
        if self.rewards is None:
            return "reference-free: no run and no --reference, so no rewards; log-prob margins only"
        if self.rewards == "length":
            return f"rewards: beta * mean log-prob per completion token ({self.objective} has no reference)"
        ref = "the base model (LoRA adapter disabled)" if self.reference == "adapter" else str(self.reference)
        return f"rewards: beta * (logp - reference logp), summed over completion tokens; reference: {ref}"


def _run_preference(run: Config) -> tuple[str, Any, Any]:
    """The objective, `preference` settings and stage `data` overrides the run ended with: those of
    the last stage that trains a preference objective (a stage's `preference` replaces the top
    level's), else the top level's (no overrides); sft where no stage trains on pairs (grpo and
    distill runs too: they are scored as an SFT run is)."""

    def pairs(name: str) -> bool:  # a preference objective (not sft, grpo or distill)
        return bool({"preference", "kto"} & set(OBJECTIVES[name].formats))

    objective, settings, data = run.training.objective, run.training.preference, None
    objective = objective if pairs(objective) else "sft"
    for stage in run.stages or []:
        t = stage.training
        obj = (t.objective if t is not None and t.objective is not None else None) or run.training.objective
        if pairs(obj):
            objective, data = obj, stage.data
            settings = t.preference if t is not None and t.preference is not None else run.training.preference
    return objective, settings, data


def preference_plan(target: Target, reference: str | None, beta: float | None) -> PreferencePlan:
    """The reference and beta for RUN_OR_MODEL: a LoRA adapter is compared with its own base (the
    adapter disabled), as `reference: base` trains; another model with `reference` (default: the
    run's `model.name_or_path`, the model a full fine-tune started from); a model without a run
    and without `reference` is not compared (log-probs only). beta: `beta`, else the run's
    `training.preference.beta`, else 0.1. A SimPO or ORPO run's rewards need no reference.

    Raises:
        UserError: `reference` given for a SimPO or ORPO run (their rewards have none).
    """
    run = target.run_config
    objective, settings, data = _run_preference(run) if run is not None else ("dpo", None, None)
    if objective == "sft":
        objective = "dpo"  # an SFT run scored on pairs: DPO's rewards against its starting model
    beta = beta if beta is not None else (settings.beta if settings is not None else 0.1)
    own = {
        "max_seq_length": getattr(data, "max_seq_length", None),
        "chat_template": getattr(data, "chat_template", None),
    }
    if not OBJECTIVES[objective].reference:  # beta times the average log-prob per completion token
        if reference is not None:
            raise UserError(
                f"--reference {reference}: this run trained {objective}, whose rewards use no reference model",
                title="invalid arguments",
            )
        return PreferencePlan(objective, beta, None, "length", **own)
    if reference is not None:
        return PreferencePlan(objective, beta, reference, "reference", **own)
    if target.adapter:
        return PreferencePlan(objective, beta, "adapter", "reference", **own)
    if run is not None:
        return PreferencePlan(objective, beta, run.model.name_or_path, "reference", **own)
    return PreferencePlan(objective, beta, None, None)


def preference_data_config(
    loaded: LoadedModel, plan: PreferencePlan, path: str, max_seq_length: int | None
) -> DataConfig:
    """The `data` section that reads the pairs at `path` as the run's preference stage did: its
    `max_seq_length` and chat template where the stage set its own, else the run's (else 1024 and
    the tokenizer's template); `max_seq_length` given wins."""
    cfg = eval_data_config(loaded, path, "preference", max_seq_length or plan.max_seq_length)
    return cfg.model_copy(update={"chat_template": plan.chat_template}) if plan.chat_template else cfg


def evaluate_preference(
    loaded: LoadedModel, data_cfg: DataConfig, plan: PreferencePlan, *, reference_model: Any = None, batch_size: int = 8
) -> dict[str, Any]:
    """Reward accuracy and margin of preference pairs, rendered and masked as training renders them
    (the data package's preference rows and collator: each micro-batch of m pairs is one forward
    over 2m rows) and scored with the trainer's `sequence_logps`.

    Args:
        loaded: the policy.
        data_cfg: a `data` section whose `train` source has `format: preference`.
        plan: from :func:`preference_plan`.
        reference_model: the loaded reference when `plan.reference` names a model to load.
        batch_size: pairs per forward.

    Returns:
        `pairs`, `truncated`, `objective`, `beta`, `rewards` (what they are), `reward_accuracy`
        (the fraction of pairs whose chosen reward is strictly above the rejected one's: a tie is
        not correct, as in training), `reward_margin` (mean chosen - rejected reward), `logp_chosen`,
        `logp_rejected` (mean summed log-probs), `logp_margin`, `logp_accuracy` (the same on the
        policy's log-probs alone). Rewards are None where the plan has none.

    Raises:
        DataError: the data cannot be read or leaves no pair to score.
    """
    import torch

    from scaletune.data import build_datasets
    from scaletune.data.preference import PreferenceCollator
    from scaletune.models import max_positions
    from scaletune.objectives.logprobs import sequence_logps

    tok = loaded.tokenizer
    bundle = build_datasets(data_cfg, tok, seed=0, max_positions=max_positions(loaded.model))
    rows = bundle.train
    collate = PreferenceCollator(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id, "preference")
    policy_parts, ref_parts, token_parts = [], [], []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = collate([rows[i] for i in range(start, min(start + batch_size, len(rows)))])
            inputs = [batch[k].to(loaded.device) for k in ("input_ids", "labels", "attention_mask", "position_ids")]
            logp, tokens = sequence_logps(loaded.model, *inputs)
            policy_parts.append(logp.double().cpu())
            token_parts.append(tokens.cpu())
            if plan.reference == "adapter":
                with loaded.model.disable_adapter():
                    ref_parts.append(sequence_logps(loaded.model, *inputs)[0].double().cpu())
            elif plan.rewards == "reference":
                ref_inputs = [t.to(next(reference_model.parameters()).device) for t in inputs]
                ref_parts.append(sequence_logps(reference_model, *ref_inputs)[0].double().cpu())
    chosen, rejected, tc, tr, ref_c, ref_r = _split_pairs(policy_parts, token_parts, ref_parts)
    out: dict[str, Any] = {
        "format": "preference",
        "pairs": int(chosen.numel()),
        "truncated": bundle.stats.get("truncated", 0),
        "objective": plan.objective,
        "beta": plan.beta,
        "reference": plan.reference,
        "rewards": plan.describe(),
        "reward_accuracy": None,
        "reward_margin": None,
        "logp_chosen": float(chosen.mean()),
        "logp_rejected": float(rejected.mean()),
        "logp_margin": float((chosen - rejected).mean()),
        "logp_accuracy": float((chosen > rejected).double().mean()),
    }
    if plan.rewards is not None:
        if plan.rewards == "length":
            rc, rr = plan.beta * chosen / tc.clamp(min=1), plan.beta * rejected / tr.clamp(min=1)
        else:
            rc, rr = plan.beta * (chosen - ref_c), plan.beta * (rejected - ref_r)
        out["reward_accuracy"] = float((rc > rr).double().mean())
        out["reward_margin"] = float((rc - rr).mean())
    return out


def _split_pairs(policy: list, tokens: list, ref: list) -> tuple:
    """(chosen, rejected) of each per-row list: every micro-batch's rows are m chosen then m rejected."""
    import torch

    def halves(parts: list) -> tuple:
        if not parts:
            return None, None
        return torch.cat([p[: p.numel() // 2] for p in parts]), torch.cat([p[p.numel() // 2 :] for p in parts])

    return (*halves(policy), *halves(tokens), *halves(ref))


def preference_table(result: dict[str, Any]) -> str:
    """The result as a Markdown table (metric, value), with what the rewards are under it."""
    lines = ["| metric | value |", "| --- | --- |", f"| pairs | {result['pairs']} |"]
    for key in ("reward_accuracy", "reward_margin", "logp_chosen", "logp_rejected", "logp_margin", "logp_accuracy"):
        value = result[key]
        lines.append(f"| {key} | {'n/a' if value is None else f'{value:.4f}'} |")
    lines.append(f"| beta | {result['beta']:g} |")
    return "\n".join(lines) + f"\n\n{result['rewards']}\n"


def write_preference_report(result: dict[str, Any], out_dir: Path) -> Path:
    """`preference-<UTC time>.json` (and its table as `.md`) in `out_dir` (created); returns the JSON's path.

    Raises:
        UserError: `out_dir` cannot be created or written.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        path, n = out_dir / f"preference-{stamp}.json", 1
        while path.exists():  # two evaluations in one second keep both
            path, n = out_dir / f"preference-{stamp}-{n}.json", n + 1
        path.write_text(json.dumps(result, indent=1) + "\n")
        path.with_suffix(".md").write_text(preference_table(result))
    except OSError as exc:
        raise UserError(f"{out_dir}: cannot write the results: {exc}", title="invalid arguments") from None
    return path
