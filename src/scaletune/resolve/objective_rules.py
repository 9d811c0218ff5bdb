"""The training objectives' cross-field rules (`resolve.rules.rule_problems` gathers them with the
others): each stage's data format is one its objective trains on; what a preference, online or
distillation objective cannot be combined with (packing, dummy or factory data, a factory model);
the frozen model a run holds (one: a reference or a teacher); a generation engine its strategy runs."""

from __future__ import annotations

from typing import Any

from scaletune.config.preference import OBJECTIVES
from scaletune.resolve.spec import Problem, RunSpec


def objective_rules(s: RunSpec) -> list[Problem]:
    """A stage's objective and its data agree; preference objectives train a Hugging Face causal LM
    on unpacked pairs; `reference: base` needs adapters to disable."""
    cfg, out = s.config, []
    for stage in s.stages:
        where = "" if not cfg.stages else f"stages.{stage.index}."
        t, d = stage.training, stage.data
        facts = OBJECTIVES[t.objective]
        on_policy = t.objective == "distill" and t.sampling is not None
        wanted = OBJECTIVES["grpo"].formats if t.sampling is not None else facts.formats
        for split, source in (("train", d.train), ("eval", d.eval)):
            if source is not None and source.format not in wanted:
                out.append(
                    Problem(
                        "objective",
                        f"{where}data.{split}.format",
                        f"{where}data.{split}.format is {source.format}, but {where}training.objective {t.objective} "
                        + ("with distill.mode on_policy " if on_policy else "")
                        + f"trains on {' or '.join(wanted)} data",
                        f"set format: {wanted[0]}"
                        if t.objective != "sft"
                        else (
                            "set training.objective: grpo (online RL)"
                            if source.format == "prompt"
                            else "set training.objective to a preference loss"
                        ),
                    )
                )
        if t.objective == "sft":
            continue
        for key, given in (
            ("data.packing", d.packing),
            ("data.dummy", d.dummy is not None),
            ("data.factory", d.factory),
        ):
            if given:
                out.append(
                    Problem(
                        "objective",
                        f"{where}{key}",
                        f"{where}{key} cannot be used with training.objective {t.objective}: "
                        + {
                            "grpo": "online RL generates its completions from prompt records",
                            "distill": "distillation compares the teacher's and the student's predictions on unpacked rows",
                        }.get(
                            t.objective,
                            "preference losses read whole chosen and rejected sequences from preference records",
                        ),
                        f"remove {key}",
                    )
                )
        if cfg.model.factory is not None:
            out.append(
                Problem(
                    "objective",
                    "model.factory",
                    f"training.objective {t.objective} needs a Hugging Face causal LM (model.name_or_path): it computes "
                    "the log-probabilities of completions from the model's decoder and head",
                    "use model.name_or_path, or objective sft",
                )
            )
        if t.objective == "grpo":
            out += _online_rules(s, t, where)
            continue
        if t.objective == "distill":
            out += _distill_rules(s, t, where)
            continue
        if t.preference.reference == "base" and cfg.model.lora is None and facts.reference:
            out.append(
                Problem(
                    "objective",
                    f"{where}training.preference.reference",
                    "training.preference.reference base is the model with its LoRA adapters disabled, but model.lora is not set",
                    "set reference: precomputed (or model), or add model.lora",
                )
            )
    return out


def _online_rules(s: RunSpec, t: Any, where: str) -> list[Problem]:
    """A grpo stage: reward functions given, a reference that exists, an engine its strategy runs."""
    out, rl = [], t.rl
    key = f"{where}training.rl"
    if not rl.rewards:
        out.append(
            Problem(
                "objective",
                f"{key}.rewards",
                f"{key}.rewards is empty: grpo trains on the rewards of its completions",
                'add one, e.g. rewards: [{function: "scaletune.rewards:exact_answer"}]',
            )
        )
    if rl.beta > 0 and rl.reference == "base" and s.config.model.lora is None:
        out.append(
            Problem(
                "objective",
                f"{key}.reference",
                f"{key}.reference base is the model with its LoRA adapters disabled, but model.lora is not set",
                "set reference: model, or add model.lora",
            )
        )
    return out + _engine_problems(s, rl.engine, key)


def _engine_problems(s: RunSpec, engine: str, key: str) -> list[Problem]:
    """An engine the strategy can run: hf generates with the trained module on each rank, which a
    mesh's tensor, context or pipeline degree splits across ranks."""
    if engine != "hf" or not s.mesh.model_parallel:
        return []
    return [
        Problem(
            "objective",
            f"{key}.engine",
            f"{key}.engine hf generates with the trained module on each rank, which {s.mesh.describe()} "
            "splits across ranks; generating through a tensor, context or pipeline split is not built",
            "set distributed.tensor_parallel, context_parallel and pipeline_parallel to 1 (or use engine: replay)",
        )
    ]


def _distill_rules(s: RunSpec, t: Any, where: str) -> list[Problem]:
    """A distill stage: a teacher named, and no second frozen model in the run (one is held); on
    policy, an engine its strategy runs."""
    out = _engine_problems(s, t.distill.engine, f"{where}training.distill") if t.sampling is not None else []
    key = f"{where}training.distill.teacher"
    if not t.distill.teacher:
        return out + [
            Problem(
                "objective",
                key,
                f"{key} is not set: distillation trains the model towards a teacher's predictions",
                "set it to a model folder, preset or Hub name with the same tokenizer",
            )
        ]
    others = [
        (f"stages.{st.index}." if s.config.stages else "") + "training"
        for st in s.stages
        if (st.training.objective == "distill" and st.training.distill.teacher != t.distill.teacher)
        or (st.training.objective in ("dpo", "ipo", "kto") and st.training.preference.reference == "model")
        or (st.training.objective == "grpo" and st.training.rl.beta > 0 and st.training.rl.reference == "model")
    ]
    if others:
        out.append(
            Problem(
                "objective",
                key,
                f"{key}: a run holds one frozen model beside the one it trains, but {others[0]} asks for "
                "another (a reference: model, or another teacher)",
                "train them as two runs, the second from the first's final/",
            )
        )
    return out
