"""What the reference model of preference training holds per rank (issue 24), per strategy.

`training.preference.reference` of the stages whose objective has a reference (DPO, IPO, KTO; ORPO
and SimPO have none):

* `model`: a frozen copy of `model.name_or_path` without adapters or quantization
  (`ModelSource.load_reference`), resident as the engine keeps the policy
  (`strategies/frozen_reference.py`): its parameters in the dtype the engine stores the policy's in (the
  run's storage dtype under single, ddp and fsdp; DeepSpeed casts modules to the compute dtype),
  whole under single / ddp / ZeRO-1/2, sharded like the policy's parameters under fsdp (rank 0's
  `ceil(d0 / W)` rows of each tensor) and ZeRO-3 (`ceil(n / W)` elements of each, plus the
  parameters below `stage3_param_persistence_threshold` kept whole once ZeRO-3 has traced a pass);
  with parameter offload the shards are in host memory. No gradients, no optimizer state. The
  activations of its no_grad forward live one layer at a time inside the policy's step (margin).
* `base`: the policy with its LoRA adapters disabled: no second model.
* `precomputed`: no second model; a table of 2 float32 per pair (8 bytes a pair on disk, the data
  set's two float64 columns in host memory: 16 bytes a pair) beside the tokenised data: negligible.
* `auto`: `base` under LoRA, else `precomputed`.

The run's most expensive stage counts (a `model` reference in any stage holds its copy then).
Distillation's teacher (`training.distill.teacher`) is held as `model` is, counted from its own
config (`teacher_params`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scaletune.config.preference import OBJECTIVES
from scaletune.resolve import FLOAT_DTYPES
from scaletune.strategies.deepspeed_config import PERSISTENCE_THRESHOLD

if TYPE_CHECKING:
    from scaletune.plan.shapes import ModelShape, ParamInfo
    from scaletune.resolve import RunSpec

_COST = {"none": 0, "base": 1, "precomputed": 2, "model": 3}


@dataclass(frozen=True)
class ReferencePlan:
    """The reference the run holds: `mode` none | base | precomputed | model, the stage it is
    planned for (None: no preference stage), and one line saying what it costs."""

    mode: str
    stage: str | None
    note: str
    #: A distillation teacher's parameters (`teacher_params`), in place of the policy's base.
    teacher: tuple[ParamInfo, ...] | None = None

    def to_json(self) -> dict:
        return {"mode": self.mode, "stage": self.stage, "note": self.note}


def stage_reference(training: object, lora: bool) -> str:
    """A stage's reference mode: none (its objective has no reference), base, precomputed or model
    (`auto` decided: base under LoRA, else precomputed). Read with defaults, so a config without
    `training.objective` plans as SFT."""
    objective = getattr(training, "objective", "sft")
    if not OBJECTIVES[objective].reference:
        return "none"
    if objective == "distill":  # the teacher: always a model of its own
        return "model"
    if objective == "grpo":  # a reference only for a weighted KL; auto: base under LoRA, else model
        rl = getattr(training, "rl", None)
        if not getattr(rl, "beta", 0):
            return "none"
        mode = getattr(rl, "reference", "auto")
        return ("base" if lora else "model") if mode == "auto" else str(mode)
    mode = getattr(getattr(training, "preference", None), "reference", "auto")
    if mode == "auto":
        return "base" if lora else "precomputed"
    return str(mode)


def reference_plan(spec: RunSpec) -> ReferencePlan:
    """The most expensive reference of the run's stages, with its note."""
    lora = spec.config.model.lora is not None
    best, stage = "none", None
    for s in spec.stages:
        mode = stage_reference(s.training, lora)
        if _COST[mode] > _COST[best]:
            best, stage = mode, s.name
    notes = {
        "none": "no reference model (no DPO, IPO or KTO stage)",
        "base": "reference base: the policy with its LoRA adapters disabled, no second model",
        "precomputed": "reference precomputed: no second model; its log-probs are a table of 2 float32 "
        "per pair (8 bytes a pair; 16 as the data set's columns in host memory), negligible",
        "model": "reference model: a frozen copy of the model's parameters (no gradients, no optimizer), "
        "whole under ddp and ZeRO-1/2, sharded 1/W under fsdp and ZeRO-3",
    }
    if spec.custom_model and best == "model":
        notes["model"] = "reference model: not available for model.factory (counted as none)"
        best = "none"
    where = f" (stage {stage})" if stage and len(spec.stages) > 1 else ""
    teacher = next((s.training.distill.teacher for s in spec.stages if s.training.objective == "distill"), None)
    if best == "model" and teacher:
        params = teacher_params(spec, teacher)
        note = (
            f"distillation teacher {teacher}: {sum(p.numel for p in params):,} frozen parameters (no gradients, "
            "no optimizer), whole under ddp and ZeRO-1/2, sharded 1/W under fsdp and ZeRO-3"
        )
        return ReferencePlan(best, stage, note + where, tuple(params))
    return ReferencePlan(best, stage, notes[best] + where)


def teacher_params(spec: RunSpec, teacher: str) -> list[ParamInfo]:
    """The teacher's parameters, counted on the meta device from its config (no weights read)."""
    from scaletune.models import DevicePlacement, load_model
    from scaletune.plan.shapes import ParamInfo

    cfg = spec.config.model.model_copy(
        update={"name_or_path": teacher, "dtype": spec.precision.storage, "quantization": None, "lora": None}
    )
    model = load_model(cfg, DevicePlacement(None, "cpu"), meta=True)
    seen: set[int] = set()
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:  # tied embeddings: one tensor
            seen.add(id(p))
            out.append(ParamInfo(name=name, shape=tuple(p.shape), trainable=False, quantized=False, in_layer=False))
    return out


def sequences_per_example(spec: RunSpec) -> int:
    """Sequences in one forward per `micro_batch_size` unit, the most of any stage: 2 where a stage
    trains on pairs (`micro_batch_size` counts pairs), num_generations for grpo and on-policy
    distillation (it counts prompts), else 1 (SFT, KTO's records)."""
    counts = [1]
    for s in spec.stages:
        if s.training.sampling is not None:
            counts.append(s.training.sampling.num_generations)
        elif OBJECTIVES[s.training.objective].paired:
            counts.append(2)
    return max(counts)


def _rows(p: ParamInfo, w: int) -> int:
    """Elements of rank 0's FSDP2 shard: dim 0 split in ceil(d0 / W) rows."""
    if not p.shape:
        return 1
    return -(-p.shape[0] // w) * math.prod(p.shape[1:])


def reference_bytes(name: str, shape: ModelShape, spec: RunSpec, w: int, ref: ReferencePlan) -> tuple[int, int]:
    """(device bytes, host bytes) rank 0 holds of the reference under the plan entry `name` (ddp,
    fsdp, zero1-3, the -offload variants) at world size `w`; (0, 0) unless the mode is `model`."""
    if ref.mode != "model":
        return 0, 0
    # The base model (no adapters), or a distillation teacher.
    params = list(ref.teacher) if ref.teacher is not None else [p for p in shape.params if "lora_" not in p.name]
    base = name.removesuffix("-offload")
    offload = name.endswith("-offload")
    if base in ("ddp", "fsdp"):
        b = FLOAT_DTYPES[spec.precision.storage][0]
        if base == "ddp":
            return b * sum(p.numel for p in params), 0
        shard = b * sum(_rows(p, w) for p in params)
        return (0, shard) if offload else (shard, 0)
    b = FLOAT_DTYPES[spec.precision.compute][0]  # DeepSpeed casts modules to the compute dtype
    if base != "zero3":
        return b * sum(p.numel for p in params), 0
    own = b * sum(-(-p.numel // w) for p in params)
    persistent = b * sum(p.numel for p in params if p.numel < PERSISTENCE_THRESHOLD)
    return (persistent, own) if offload else (own + persistent, 0)
