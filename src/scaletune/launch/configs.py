"""Standalone DeepSpeed JSON and FSDP configs for users of other trainers (`scaletune config ...`).

`auto` marks the values the Hugging Face Trainer fills from its `TrainingArguments`
(batch sizes, gradient accumulation and clipping, optimizer hyper-parameters, precision);
give the value on the command line to write it down instead.
"""

from __future__ import annotations

from typing import Any, Literal

import yaml

from scaletune.errors import UserError

Precision = Literal["auto", "bf16", "fp16", "fp32"]


def deepspeed_config(
    zero_stage: int = 2,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    precision: Precision = "auto",
    gradient_accumulation_steps: int | None = None,
    gradient_clipping: float | None = None,
    micro_batch_size: int | None = None,
) -> dict[str, Any]:
    """A DeepSpeed config dict (ZeRO stage 1-3, optional CPU offload).

    Unset values are `"auto"`, which the HF Trainer fills. With `micro_batch_size` and
    `gradient_accumulation_steps` both given the batch part is concrete (DeepSpeed derives
    `train_batch_size` from the world size), so the file also works with `deepspeed.initialize`.

    Raises:
        UserError: a stage outside 1-3, parameter offload below stage 3, bad numbers.
    """
    p = []
    if zero_stage not in (0, 1, 2, 3):
        p.append(f"--zero-stage must be 0, 1, 2 or 3, got {zero_stage}")
    if offload_params and zero_stage != 3:
        p.append("--offload-params needs --zero-stage 3 (only ZeRO-3 partitions parameters)")
    if offload_optimizer and zero_stage == 0:
        p.append("--offload-optimizer needs --zero-stage 1, 2 or 3")
    if gradient_accumulation_steps is not None and gradient_accumulation_steps < 1:
        p.append(f"--gradient-accumulation-steps must be 1 or more, got {gradient_accumulation_steps}")
    if micro_batch_size is not None and micro_batch_size < 1:
        p.append(f"--micro-batch-size must be 1 or more, got {micro_batch_size}")
    if gradient_clipping is not None and gradient_clipping < 0:
        p.append(f"--gradient-clipping must be 0 or more, got {gradient_clipping}")
    if precision not in ("auto", "bf16", "fp16", "fp32"):
        p.append(f"precision must be auto, bf16, fp16 or fp32, got {precision!r}")
    if p:
        raise UserError(p, title="invalid deepspeed options")

    concrete_batch = micro_batch_size is not None and gradient_accumulation_steps is not None
    cfg: dict[str, Any] = {}
    if not concrete_batch:
        cfg["train_batch_size"] = "auto"
    cfg["train_micro_batch_size_per_gpu"] = micro_batch_size if micro_batch_size is not None else "auto"
    cfg["gradient_accumulation_steps"] = gradient_accumulation_steps if gradient_accumulation_steps is not None else "auto"
    cfg["gradient_clipping"] = gradient_clipping if gradient_clipping is not None else "auto"
    enabled = {"auto": ("auto", "auto"), "bf16": (True, False), "fp16": (False, True), "fp32": (False, False)}[precision]
    cfg["bf16"] = {"enabled": enabled[0]}
    cfg["fp16"] = {
        "enabled": enabled[1],
        "loss_scale": 0,  # dynamic loss scaling
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
    if offload_optimizer:
        # ZeRO-Offload runs the optimizer step on the CPU with DeepSpeed's CPUAdam, which needs
        # DeepSpeed to own the optimizer: declare it (the HF Trainer fills the `auto` values).
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage >= 1:
        zero.update({"overlap_comm": True, "contiguous_gradients": True})
    if zero_stage == 2:
        zero.update({"allgather_partitions": True, "reduce_scatter": True})
    if zero_stage == 3:
        # Lets the HF Trainer (and scaletune export) save a consolidated 16-bit model.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg["zero_optimization"] = zero
    cfg["steps_per_print"] = 100
    cfg["wall_clock_breakdown"] = False
    return cfg


FsdpFormat = Literal["trainer", "accelerate"]


def fsdp_config(
    reshard_after_forward: bool = True,
    mixed_precision: Literal["bf16", "fp16", "no"] = "bf16",
    cpu_offload: bool = False,
    state_dict_type: Literal["sharded", "full"] = "sharded",
    activation_checkpointing: bool = False,
    fmt: FsdpFormat = "trainer",
) -> tuple[str, str]:
    """An FSDP2 config.

    `fmt="trainer"`: JSON for `TrainingArguments(fsdp=True, fsdp_config=FILE)` (mixed precision
    is a TrainingArguments flag there: `--bf16`/`--fp16`; it is recorded under a `_comment`).
    `fmt="accelerate"`: YAML for `accelerate launch --config_file FILE` (it carries
    `mixed_precision` itself).

    Returns:
        (text, suffix): the file's contents and its usual suffix (".json" or ".yaml").

    Raises:
        UserError: unknown mixed precision, state dict type or format.
    """
    p = []
    if mixed_precision not in ("bf16", "fp16", "no"):
        p.append(f"--mixed-precision must be bf16, fp16 or no, got {mixed_precision!r}")
    if state_dict_type not in ("sharded", "full"):
        p.append(f"--state-dict-type must be sharded or full, got {state_dict_type!r}")
    if fmt not in ("trainer", "accelerate"):
        p.append(f"--format must be trainer or accelerate, got {fmt!r}")
    if p:
        raise UserError(p, title="invalid fsdp options")
    sdt = {"sharded": "SHARDED_STATE_DICT", "full": "FULL_STATE_DICT"}[state_dict_type]
    if fmt == "trainer":
        import json

        cfg = {
            "_comment": (
                f"FSDP2 config for transformers.TrainingArguments(fsdp=True, fsdp_config=THIS_FILE); "
                f"mixed precision: pass {'bf16=True' if mixed_precision == 'bf16' else 'fp16=True' if mixed_precision == 'fp16' else 'neither bf16 nor fp16'} "
                "to TrainingArguments. Written by `scaletune config fsdp`."
            ),
            "version": 2,
            "reshard_after_forward": reshard_after_forward,
            "cpu_offload": cpu_offload,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "state_dict_type": sdt,
            "activation_checkpointing": activation_checkpointing,
            "cpu_ram_efficient_loading": True,
        }
        return json.dumps(cfg, indent=2) + "\n", ".json"
    cfg = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "mixed_precision": mixed_precision,
        "num_machines": 1,
        "num_processes": 1,  # `accelerate launch --num_processes N` overrides
        "machine_rank": 0,
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": reshard_after_forward,
            "fsdp_offload_params": cpu_offload,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_state_dict_type": sdt,
            "fsdp_activation_checkpointing": activation_checkpointing,
            "fsdp_cpu_ram_efficient_loading": True,
        },
    }
    header = "# FSDP2 config for `accelerate launch --config_file THIS_FILE`. Written by `scaletune config fsdp`.\n"
    return header + yaml.safe_dump(cfg, sort_keys=False), ".yaml"
