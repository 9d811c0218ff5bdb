"""THE DeepSpeed JSON generator (torch-free): the engine's config (`strategies/deepspeed.py`, every
value concrete) and `scaletune config deepspeed` (values left to the Hugging Face Trainer written
as "auto") both come from :func:`deepspeed_json`, so they agree key for key.

Defaults follow DeepSpeed's documentation for ZeRO (https://www.deepspeed.ai/docs/config-json/):
communication overlapped with backward, contiguous gradient buffers, 5e8-element buckets, ZeRO-3
prefetch of 5e7 elements and parameters below 1e5 elements kept whole on every rank (the planner
counts them: `plan/estimates.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from scaletune.errors import ConfigError
from scaletune.resolve.spec import FLOAT_DTYPES

PrecisionName = Literal["auto", "bf16", "fp16", "fp32"]
REDUCE_BUCKET = int(5e8)
ALLGATHER_BUCKET = int(5e8)
PREFETCH_BUCKET = int(5e7)
PERSISTENCE_THRESHOLD = int(1e5)

# Keys scaletune derives from the YAML; a user's JSON that sets them differently is an error
# (accepted when equal or "auto", as in HF Trainer's DeepSpeed integration).
_DERIVED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")


def precision_name(compute_dtype: str) -> PrecisionName:
    """`bfloat16` -> `bf16`, `float16` -> `fp16`, `float32` -> `fp32`."""
    return FLOAT_DTYPES[compute_dtype][1]  # type: ignore[return-value]


def deepspeed_json(
    zero_stage: int,
    *,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    precision: PrecisionName = "auto",
    train_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    gradient_accumulation_steps: int | None = None,
    gradient_clipping: float | None = None,
    optimizer_section: bool = False,
) -> dict[str, Any]:
    """A DeepSpeed config dict.

    Args:
        zero_stage: 1 (optimizer state sharded), 2 (and gradients), 3 (and parameters); 0 for
            plain data parallelism (the `config deepspeed` command only).
        offload_optimizer, offload_params: ZeRO-Offload of optimizer state / parameters to the CPU.
        precision: bf16 / fp16 (with dynamic loss scaling) / fp32, or "auto" (the HF Trainer decides).
        train_batch_size, micro_batch_size, gradient_accumulation_steps, gradient_clipping: None
            writes "auto"; a given micro batch and accumulation without a global batch leave
            `train_batch_size` out (DeepSpeed derives it from the world size).
        optimizer_section: declare DeepSpeed's AdamW with "auto" hyper-parameters, for trainers that
            do not pass their own optimizer (the HF Trainer with optimizer offload, where DeepSpeed
            must own a CPU optimizer). scaletune's engine passes its own and leaves this off.

    Raises:
        ConfigError: a stage outside 0-3, parameter offload below stage 3, bad numbers.
    """
    # Messages name `scaletune config deepspeed`'s options: a resolved run never gets here with
    # values its schema and rules refused.
    p = []
    if zero_stage not in (0, 1, 2, 3):
        p.append(f"--zero-stage must be 0, 1, 2 or 3, got {zero_stage}")
    if offload_params and zero_stage != 3:
        p.append("--offload-params needs --zero-stage 3 (only ZeRO-3 partitions parameters)")
    if offload_optimizer and zero_stage == 0:
        p.append("--offload-optimizer needs --zero-stage 1, 2 or 3")
    for name, v in (
        ("--gradient-accumulation-steps", gradient_accumulation_steps),
        ("--micro-batch-size", micro_batch_size),
        ("--train-batch-size", train_batch_size),
    ):
        if v is not None and v < 1:
            p.append(f"{name} must be 1 or more, got {v}")
    if gradient_clipping is not None and gradient_clipping < 0:
        p.append(f"--gradient-clipping must be 0 or more, got {gradient_clipping}")
    if precision not in ("auto", "bf16", "fp16", "fp32"):
        p.append(f"precision must be auto, bf16, fp16 or fp32, got {precision!r}")
    if p:
        raise ConfigError(p, title="invalid deepspeed options")

    def auto(v: Any) -> Any:
        return "auto" if v is None else v

    cfg: dict[str, Any] = {}
    if train_batch_size is not None or micro_batch_size is None or gradient_accumulation_steps is None:
        cfg["train_batch_size"] = auto(train_batch_size)
    cfg["train_micro_batch_size_per_gpu"] = auto(micro_batch_size)
    cfg["gradient_accumulation_steps"] = auto(gradient_accumulation_steps)
    cfg["gradient_clipping"] = auto(gradient_clipping)
    enabled = {"auto": ("auto", "auto"), "bf16": (True, False), "fp16": (False, True), "fp32": (False, False)}[
        precision
    ]
    cfg["bf16"] = {"enabled": enabled[0]}
    cfg["fp16"] = {
        "enabled": enabled[1],
        "loss_scale": 0,  # dynamic loss scaling
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
    if optimizer_section:
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage >= 1:
        zero.update({"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": REDUCE_BUCKET})
    if zero_stage in (1, 2):
        zero.update({"allgather_partitions": True, "allgather_bucket_size": ALLGATHER_BUCKET, "reduce_scatter": True})
    if zero_stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": PREFETCH_BUCKET,
                "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
                # So an exported model holds every weight, not rank 0's partition.
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg["zero_optimization"] = zero
    cfg["steps_per_print"] = 10**9  # the trainer logs; DeepSpeed's own step lines stay out
    cfg["wall_clock_breakdown"] = False
    return cfg


def merge_user_config(generated: dict[str, Any], user: dict[str, Any] | None, source: str) -> dict[str, Any]:
    """A user's DeepSpeed JSON with the generated keys on top. Its other keys are kept; batch sizes,
    accumulation, clipping, precision and the ZeRO stage must agree with the generated values or be
    "auto"; under `zero_optimization` the generated keys are defaults the user's override.

    Raises:
        ConfigError: naming every key where the user's JSON and the YAML disagree.
    """
    if not user:
        return generated
    cfg: dict[str, Any] = json.loads(json.dumps(user))
    problems = []
    for key in _DERIVED:
        theirs = cfg.get(key, "auto")
        if key in generated and theirs != "auto" and theirs != generated[key]:
            problems.append(f"{source}: {key} is {theirs} but the YAML gives {generated[key]}")
        if key in generated:
            cfg[key] = generated[key]
    for name in ("bf16", "fp16"):
        block = cfg.get(name) if isinstance(cfg.get(name), dict) else {}
        theirs, want = block.get("enabled", "auto"), generated[name]["enabled"]
        if theirs != "auto" and want != "auto" and bool(theirs) != want:
            problems.append(f"{source}: {name}.enabled is {theirs} but model.dtype is {_other(generated)}")
        cfg[name] = {**generated[name], **{k: v for k, v in block.items() if k != "enabled"}, "enabled": want}
    zero = cfg.get("zero_optimization") if isinstance(cfg.get("zero_optimization"), dict) else {}
    stage = zero.get("stage", "auto")
    if stage != "auto" and stage != generated["zero_optimization"]["stage"]:
        problems.append(
            f"{source}: zero_optimization.stage is {stage} but distributed.zero_stage is {generated['zero_optimization']['stage']}"
        )
    merged_zero = {**generated["zero_optimization"], **zero, "stage": generated["zero_optimization"]["stage"]}
    for key in ("offload_optimizer", "offload_param", "stage3_gather_16bit_weights_on_model_save"):
        if key in generated["zero_optimization"]:
            merged_zero[key] = generated["zero_optimization"][key]
    cfg["zero_optimization"] = merged_zero
    for key, value in generated.items():
        cfg.setdefault(key, value)
    if problems:
        raise ConfigError(problems, title="distributed.deepspeed_config disagrees with the YAML")
    return cfg


def _other(generated: dict[str, Any]) -> str:
    """The dtype name the generated JSON enables (float32 where neither bf16 nor fp16 is)."""
    enabled = [name for name, (_, short) in FLOAT_DTYPES.items() if generated.get(short, {}).get("enabled") is True]
    return enabled[0] if enabled else "float32"


def read_user_config(path: str | None) -> dict | None:
    """Parse a user's DeepSpeed JSON.

    Raises:
        ConfigError: missing file or invalid JSON (with its line).
    """
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"distributed.deepspeed_config: {path} does not exist", title="invalid config")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}", title="invalid config") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read: {exc}", title="invalid config") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a DeepSpeed config must be a JSON object", title="invalid config")
    return data


def engine_config(spec: Any) -> dict[str, Any]:
    """The engine's DeepSpeed config for a resolved run (:class:`scaletune.resolve.RunSpec`),
    merged with the user's `distributed.deepspeed_config`.

    Raises:
        ConfigError: the user's JSON is unreadable or disagrees with the YAML.
    """
    t, b = spec.config.training, spec.batch
    generated = deepspeed_json(
        spec.zero_stage,
        offload_optimizer=spec.offload_optimizer,
        offload_params=spec.offload_params,
        precision=precision_name(spec.precision.compute),
        train_batch_size=b.global_batch_size,
        micro_batch_size=b.micro_batch_size,
        gradient_accumulation_steps=b.gradient_accumulation_steps,
        gradient_clipping=t.max_grad_norm or 0.0,
    )
    if spec.offload_optimizer and not steps_with_cpu_adam(spec):
        # The client optimizer is torch's AdamW (see steps_with_cpu_adam): DeepSpeed refuses any
        # optimizer but its own CPU ones under ZeRO-Offload unless told it is meant.
        generated["zero_force_ds_cpu_optimizer"] = False
    path = spec.config.distributed.deepspeed_config
    return merge_user_config(generated, read_user_config(path), path or "deepspeed_config")


def steps_with_cpu_adam(spec: Any) -> bool:
    """Whether the run steps its optimizer with DeepSpeed's `DeepSpeedCPUAdam` (ZeRO-Offload on GPUs).

    ZeRO-Offload moves the optimizer state and step to the host, where DeepSpeed's vectorised CPU
    Adam is the optimizer it is built for. On a machine without GPUs (`DS_ACCELERATOR=cpu`) the
    model, its gradients and its optimizer are on the host already, offloaded or not, so the run
    steps with torch's AdamW as the other engines there do: CPU Adam is a C++ extension DeepSpeed
    compiles on first use (`CPUAdamBuilder`, about 4 CPU-minutes on 2 cores), a cost a CPU run
    would pay for nothing it needs.

    Args:
        spec: a resolved run (:class:`scaletune.resolve.RunSpec`).
    """
    return spec.strategy == "deepspeed" and spec.offload_optimizer and spec.env.cuda_available
