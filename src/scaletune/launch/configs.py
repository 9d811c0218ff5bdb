"""Standalone DeepSpeed JSON and FSDP configs for users of other trainers (`scaletune config ...`).

`auto` marks the values the Hugging Face Trainer fills from its `TrainingArguments`
(batch sizes, gradient accumulation and clipping, optimizer hyper-parameters, precision);
give the value on the command line to write it down instead.
"""

from __future__ import annotations

from typing import Any, Literal

import yaml

from scaletune.errors import UserError
from scaletune.strategies.deepspeed_config import PrecisionName, deepspeed_json


def deepspeed_config(
    zero_stage: int = 2,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    precision: PrecisionName = "auto",
    gradient_accumulation_steps: int | None = None,
    gradient_clipping: float | None = None,
    micro_batch_size: int | None = None,
    train_batch_size: int | None = None,
) -> dict[str, Any]:
    """`scaletune config deepspeed`: the one DeepSpeed generator
    (:func:`scaletune.strategies.deepspeed_config.deepspeed_json`) with unset values `"auto"`, which
    the HF Trainer fills. With optimizer offload DeepSpeed must own the optimizer (its CPU Adam), so
    the file declares one. With `micro_batch_size` and `gradient_accumulation_steps` both given the
    batch part is concrete, so the file also works with `deepspeed.initialize`.

    Raises:
        UserError: a stage outside 0-3, parameter offload below stage 3, bad numbers.
    """
    return deepspeed_json(
        zero_stage,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        precision=precision,
        train_batch_size=train_batch_size,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        gradient_clipping=gradient_clipping,
        optimizer_section=offload_optimizer,
    )


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
