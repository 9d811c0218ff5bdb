"""Every cross-field rule of a run, each a small function over the decided :class:`RunSpec` that
returns the :class:`Problem` s it finds (the doctor shows the same problems as checks)."""

from __future__ import annotations

from scaletune.resolve.mesh import mesh_problems
from scaletune.resolve.objective_rules import objective_rules
from scaletune.resolve.precision import mixed_precision_problems
from scaletune.resolve.spec import Problem, RunSpec, batch_problem

# Attention implementations that build their mask through transformers' masking_utils, which
# keeps packed examples apart by position_ids when no attention_mask is given (data/batching.py).
PACKING_SAFE_ATTENTION = ("sdpa", "eager", "flex_attention")


def quantization_problem(quantized: bool, lora: bool, prefix: str = "model.") -> Problem | None:
    """Quantized base weights are frozen: they train only through LoRA adapters (QLoRA). `prefix`:
    how the keys are named (`model.` in a config, empty for `scaletune.hf`'s arguments)."""
    if not quantized or lora:
        return None
    return Problem(
        "quantization",
        f"{prefix}quantization",
        f"{prefix}quantization freezes the base weights in 4/8 bits, which cannot be trained: it needs {prefix}lora (QLoRA)",
        f"add {prefix}lora or drop {prefix}quantization",
    )


def liger_problem(liger: bool, zero3: bool, chosen: str = "") -> Problem | None:
    """Liger's fused linear cross-entropy takes lm_head.weight as a tensor and multiplies it outside
    lm_head's forward; ZeRO-3 gathers a partitioned weight only inside its owner's forward."""
    if not (liger and zero3):
        return None
    return Problem(
        "liger",
        "model.liger",
        f"model.liger cannot run under deepspeed zero_stage 3{chosen}: Liger's fused linear cross-entropy reads "
        "lm_head.weight outside lm_head's forward, where ZeRO-3 keeps that weight partitioned (an empty placeholder)",
        "use zero_stage 1 or 2, strategy fsdp, or model.liger: false",
    )


def _strategy_rules(s: RunSpec) -> list[Problem]:
    out = []
    if s.strategy == "single" and s.world_size > 1:
        out.append(
            Problem(
                "strategy",
                "distributed.strategy",
                f"distributed.strategy single cannot run on {s.world_size} ranks",
                "use ddp, fsdp or deepspeed",
            )
        )
    if s.strategy in ("single", "ddp") and (s.offload_optimizer or s.offload_params):
        out.append(
            Problem(
                "offload",
                "distributed.strategy",
                f"distributed.strategy {s.strategy} has no offload",
                "use strategy deepspeed (offload_optimizer, offload_params) or fsdp (offload_params)",
            )
        )
    if s.strategy == "fsdp" and s.offload_optimizer:
        out.append(
            Problem(
                "offload",
                "distributed.offload_optimizer",
                "distributed.offload_optimizer is DeepSpeed's",
                "under fsdp set offload_params: true, which offloads parameters, gradients and optimizer state together",
            )
        )
    if s.strategy == "deepspeed" and s.offload_params and s.zero_stage != 3:
        out.append(
            Problem(
                "offload",
                "distributed.offload_params",
                "distributed.offload_params needs zero_stage 3",
                "ZeRO-1/2 do not partition parameters: set zero_stage: 3 or drop offload_params",
            )
        )
    return out


def _model_rules(s: RunSpec) -> list[Problem]:
    m, out = s.config.model, []
    q = m.quantization
    out += [p for p in [quantization_problem(q is not None, m.lora is not None)] if p]
    if q is not None and s.strategy == "fsdp":
        # Rank 0 would load bitsandbytes' 4-bit weights while the other ranks build unquantized meta
        # weights, and moving the model to meta (before sharding) drops the quantization state.
        out.append(
            Problem(
                "quantization strategy",
                "model.quantization",
                f"model.quantization cannot run under strategy fsdp{' (chosen by distributed.strategy auto)' if s.requested == 'auto' else ''}: "
                "scaletune's FSDP loads the weights on rank 0 and builds the others on the meta device, which "
                "loses bitsandbytes' quantization state",
                f"use strategy ddp (every rank holds the 4-bit model), or strategy deepspeed with zero_stage 3 and "
                f"model.quantization.storage_dtype: {m.dtype}",
            )
        )
    elif q is not None and s.shards_params:
        if q.bits == 8:
            out.append(
                Problem(
                    "quantization strategy",
                    "model.quantization.bits",
                    f"model.quantization bits 8 cannot be sharded by {s.strategy_label} (LLM.int8()'s 8-bit weights keep per-row state FSDP and ZeRO-3 cannot flatten)",
                    f"use bits: 4 with storage_dtype: {m.dtype}, or strategy ddp",
                )
            )
        elif q.storage_dtype != m.dtype:
            # FSDP/ZeRO-3 flatten each unit's parameters into one tensor of one dtype; 4-bit weights
            # packed as uint8 cannot join the bf16 ones (QLoRA with FSDP, Answer.AI/HF 2024).
            out.append(
                Problem(
                    "quantization storage dtype",
                    "model.quantization.storage_dtype",
                    f"model.quantization under {s.strategy_label}: 4-bit weights stored as {q.storage_dtype} cannot be "
                    f"flattened into one shard with the other parameters ({m.dtype})",
                    f"set model.quantization.storage_dtype: {m.dtype} (equal to model.dtype, bitsandbytes' bnb_4bit_quant_storage)",
                )
            )
    zero3 = s.strategy == "deepspeed" and s.zero_stage == 3
    chosen = " (chosen by distributed.strategy auto)" if s.requested == "auto" else ""
    out += [p for p in [liger_problem(m.liger, zero3, chosen)] if p]
    if m.compile and zero3:
        # ZeRO-3 gathers and releases each parameter from module hooks, which torch.compile cannot trace.
        out.append(
            Problem(
                "compile",
                "model.compile",
                f"model.compile cannot run under deepspeed zero_stage 3{chosen} (its parameter-gathering hooks break the compiled graph)",
                "use zero_stage 1 or 2, strategy fsdp, or model.compile: false",
            )
        )
    return out


def _stage_rules(s: RunSpec) -> list[Problem]:
    cfg, out = s.config, []
    names = [st.name for st in cfg.stages]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        out.append(
            Problem("stages", "stages", f"stages: names must be unique, repeated: {', '.join(dupes)}", "rename them")
        )
    for i, st in enumerate(cfg.stages):
        given = st.training.model_dump(exclude_none=True) if st.training else {}
        clash = sorted(k for k in ("learning_rate", "lr_scheduler", "warmup_steps", "min_lr_ratio") if k in given)
        if st.continue_schedule and clash:
            out.append(
                Problem(
                    "stages",
                    f"stages.{i}.continue_schedule",
                    f"stages[{i}] continues the running schedule (continue_schedule: true), so its {', '.join(clash)} would be ignored",
                    "remove them or set continue_schedule: false",
                )
            )
    resume = cfg.training.resume
    if isinstance(resume, str) and not resume.strip():
        out.append(Problem("resume", "training.resume", "training.resume must be null, auto or a checkpoint path"))
    for stage in s.stages:
        key = "data.max_seq_length" if not cfg.stages else f"stages.{stage.index}.data.max_seq_length"
        too_long = positions_problem(stage.data.max_seq_length, s.max_positions, key)
        out += [too_long] if too_long else []
        if stage.data.packing:
            out += packing_problems(
                cfg.model.attn_implementation, cfg.training.micro_batch_size, key.replace("max_seq_length", "packing")
            )
    return out


def positions_problem(
    max_seq_length: int, max_positions: int | None, key: str = "data.max_seq_length"
) -> Problem | None:
    """Sequences may not be longer than the positions the model was built for."""
    if max_positions is None or max_seq_length <= max_positions:
        return None
    return Problem(
        "max positions",
        key,
        f"data.max_seq_length ({max_seq_length}) is larger than the model's max_position_embeddings "
        f"({max_positions}), the positions it was built for",
        f"set data.max_seq_length to {max_positions} or less",
    )


def packing_problems(attn: str | None, micro_batch_size: int, key: str = "data.packing") -> list[Problem]:
    """transformers keeps packed examples apart only without an attention_mask and with
    position_ids restarting per example: masking_utils then builds a block-diagonal causal mask for
    sdpa, eager and flex_attention. The flash-attention kernels read packing from position_ids only
    for a batch of ONE row (`_is_packed_sequence`); other (custom) implementations get no mask."""
    impl = attn or "sdpa"
    if impl in PACKING_SAFE_ATTENTION or (impl.startswith("flash_attention") and micro_batch_size == 1):
        return []
    if impl.startswith("flash_attention"):
        return [
            Problem(
                "packing",
                key,
                f"data.packing with model.attn_implementation {impl} keeps packed examples apart only with "
                f"training.micro_batch_size 1 (it is {micro_batch_size})",
                "set micro_batch_size: 1, or use sdpa",
            )
        ]
    return [
        Problem(
            "packing",
            key,
            f"data.packing: model.attn_implementation {impl} cannot keep packed examples apart (attention would leak between them)",
            f"use one of {', '.join(PACKING_SAFE_ATTENTION)} or set data.packing: false",
        )
    ]


def _environment_rules(s: RunSpec) -> list[Problem]:
    """Settings that name devices this machine must have."""
    out, env = [], s.env
    n, device_map = s.config.distributed.num_processes, s.config.model.device_map or ""
    if device_map.startswith("cuda:") and not env.launched and int(device_map[5:]) >= env.cuda_device_count:
        seen = f"{env.cuda_device_count} GPU(s) are visible" if env.cuda_available else "no GPU is visible"
        fix = "set it to a visible device, null, or cpu (check CUDA_VISIBLE_DEVICES)"
        out.append(Problem("device_map", "model.device_map", f"model.device_map {device_map}: {seen}", fix))
    if not env.launched and env.cuda_available and isinstance(n, int) and n > env.cuda_device_count:
        message = f"distributed.num_processes is {n} but only {env.cuda_device_count} GPU(s) are visible"
        fix = f"set it to {env.cuda_device_count} or auto (check CUDA_VISIBLE_DEVICES)"
        out.append(Problem("processes per GPU", "distributed.num_processes", message, fix))
    return out


#: Model options that only mean something for a `from_pretrained` model (`model.factory` builds the
#: module itself): key -> why.
_HF_ONLY = {
    "lora": "LoRA is injected into Hugging Face causal LMs; apply peft inside your factory or freeze with stages[].trainable",
    "quantization": "bitsandbytes quantizes while from_pretrained loads; quantize inside your factory",
    "liger": "Liger patches Hugging Face architectures",
    "device_map": "device_map is from_pretrained's placement; a factory's module goes to the rank's device",
}


def _factory_rules(s: RunSpec) -> list[Problem]:
    """`model.factory` / `data.factory`: the options that do not apply to them, and their kwargs."""
    m, out = s.config.model, []
    if m.factory is None:
        for key in ("shard_modules", "factory_kwargs"):
            if getattr(m, key):
                out.append(
                    Problem(
                        "factory",
                        f"model.{key}",
                        f"model.{key} is given without model.factory",
                        "add model.factory or remove it",
                    )
                )
    else:
        for key, why in _HF_ONLY.items():
            if getattr(m, key) not in (None, False):
                out.append(
                    Problem(
                        "factory",
                        f"model.{key}",
                        f"model.{key} cannot be used with model.factory: {why}",
                        f"remove model.{key}",
                    )
                )
    for stage in s.stages:
        d = stage.data
        where = "data" if not s.config.stages else f"stages.{stage.index}.data"
        if d.factory is None:
            if d.factory_kwargs:
                out.append(
                    Problem(
                        "factory",
                        f"{where}.factory_kwargs",
                        f"{where}.factory_kwargs is given without a data factory",
                        "add data.factory or remove it",
                    )
                )
            continue
        for key in ("train", "dummy", "eval"):
            if getattr(d, key) is not None:
                out.append(
                    Problem(
                        "factory",
                        f"{where}.{key}",
                        f"{where}.{key} and data.factory both give data",
                        f"remove {where}.{key} (the factory returns the train and eval sets)",
                    )
                )
        if d.packing:
            out.append(
                Problem(
                    "factory",
                    f"{where}.packing",
                    f"{where}.packing applies to text data, not to a data factory's batches",
                    "set packing: false",
                )
            )
    return out


def rule_problems(spec: RunSpec) -> list[Problem]:
    """Every cross-field rule, on the decided run."""
    out = _environment_rules(spec) + _strategy_rules(spec) + _model_rules(spec) + _factory_rules(spec)
    out += objective_rules(spec) + mixed_precision_problems(spec) + mesh_problems(spec)
    bad = batch_problem(spec.batch.global_batch_size, spec.batch.micro_batch_size, spec.batch.world_size)
    if bad is not None:
        out.append(bad)
    return out + _stage_rules(spec)
