"""THE precision rule (:func:`precision_for`) and the rules of `model.mixed_precision`
(:func:`mixed_precision_problems`), torch-free like the rest of resolve/."""

from __future__ import annotations

import re

from scaletune.config import Config
from scaletune.env import DistributedEnv
from scaletune.resolve.spec import Precision, Problem, RunSpec

#: device_map values that keep the whole model on one device (the others split it over GPUs).
_ONE_DEVICE = re.compile(r"^(cpu|cuda:\d+)$")


def precision_for(cfg: Config, env: DistributedEnv, strategy: str) -> Precision:
    """THE precision rule. `model.dtype: auto` is bfloat16 on a GPU that supports it, else float32;
    trainable weights are stored in float32, a frozen LoRA base in the compute dtype.

    The loop autocasts to the compute dtype whenever a floating-point parameter is wider than it,
    except under engines that cast every parameter themselves (FSDP2's MixedPrecisionPolicy,
    DeepSpeed's bf16/fp16 modes). That is: full fine-tuning below float32 (fp32 master weights), and
    LoRA below float32 even though its base is stored in the compute dtype, because peft creates the
    adapters in float32 (`autocast_adapter_dtype=True`, its default) and, for a quantized base (QLoRA),
    `prepare_model_for_kbit_training` upcasts every parameter that is not 4/8-bit (norms, embeddings,
    head) to float32. Without autocast those run in float32, and so do the activations that flow out
    of them: twice the activation memory and no flash-attention kernel.

    `model.mixed_precision: bf16_params` under single/ddp (a bfloat16 full fine-tune; the rules refuse
    the rest) replaces autocast by bfloat16 copies of the weights (`Precision.cast_params`): autocast
    leaves the residual stream in float32, the copies make it bfloat16.
    """
    compute = cfg.model.dtype
    if compute == "auto":
        compute = "bfloat16" if env.cuda_available and env.bf16_supported else "float32"
    storage = compute if cfg.model.lora is not None else "float32"
    wider = compute != "float32" and (storage != compute or cfg.model.lora is not None)
    own = strategy in ("single", "ddp")
    cast = own and cfg.model.mixed_precision == "bf16_params" and compute == "bfloat16" and cfg.model.lora is None
    return Precision(compute, storage, autocast=wider and own and not cast, cast_params=cast)


def mixed_precision_problems(s: RunSpec) -> list[Problem]:
    """`model.mixed_precision: bf16_params` where single/ddp cannot do it. Under fsdp and deepspeed it
    is accepted and changes nothing: their mixed precision already casts the parameters."""
    m, key = s.config.model, "model.mixed_precision"
    if m.mixed_precision != "bf16_params" or s.strategy not in ("single", "ddp"):
        return []
    out = []
    if s.precision.compute != "bfloat16":
        resolved = f" (auto resolved to {s.precision.compute} here)" if m.dtype == "auto" else ""
        out.append(
            Problem(
                "mixed precision",
                key,
                f"{key} bf16_params computes with bfloat16 copies of the weights, but model.dtype is {m.dtype}{resolved}",
                "set model.dtype: bfloat16, or mixed_precision: autocast (float16 needs autocast's loss scaling)",
            )
        )
    if m.lora is not None or m.quantization is not None:
        out.append(
            Problem(
                "mixed precision",
                key,
                f"{key} bf16_params is for full fine-tuning: under LoRA{'/QLoRA' if m.quantization else ''} the frozen "
                "base is stored in the compute dtype already, so autocast keeps a bfloat16 residual stream",
                "drop model.mixed_precision (autocast) or model.lora",
            )
        )
    if m.device_map is not None and not _ONE_DEVICE.match(m.device_map):
        out.append(
            Problem(
                "mixed precision",
                key,
                f"{key} bf16_params keeps the model on one device (FSDP2's replicate mesh), but model.device_map "
                f"{m.device_map} splits it over several",
                "use device_map: null or cuda:N, or strategy fsdp (which shards the model and casts its parameters)",
            )
        )
    return out
