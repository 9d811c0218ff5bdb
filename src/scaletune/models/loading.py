"""Model and tokenizer loading through `from_pretrained`, so a tiny local model exercises the
same path as a hub checkpoint.

* :func:`load_tokenizer`, :func:`load_config`, :func:`load_model` (or the architecture alone on
  the meta device); local paths that do not exist are never sent to the hub, and custom code in
  a checkpoint is refused unless `model.trust_remote_code` says otherwise.
* :func:`bnb_config`: `model.quantization` as a `BitsAndBytesConfig`, after checking the
  environment can run it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletune.config import ModelConfig, QuantizationConfig
from scaletune.errors import UserError
from scaletune.models.hub import HostileHubAnswer, guard_hub_answers, shared_snapshot
from scaletune.models.presets import PRESETS
from scaletune.models.pretrained import PRETRAINED, no_load_bars, pretrained_path

if TYPE_CHECKING:  # torch and transformers are imported lazily: `scaletune --help` stays fast
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from scaletune.models.placement import DevicePlacement

# A child of the "scaletune" logger, whose handler and rank-aware level (env.set_rank) it follows.
log = logging.getLogger(__name__)

# A Hugging Face hub id: `name` or `owner/name`, letters, digits, `-`, `_`, `.`.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def _looks_local(name: str) -> bool:
    """True for strings that can only mean a local path (absolute, relative with ./ or ../, ~,
    more than one `/`, backslashes), which must not be sent to the hub when missing."""
    return (
        name.startswith(("/", "./", "../", "~", "\\"))
        or name in (".", "..")
        or not _HUB_ID.fullmatch(name)
        or ".." in name
        or "--" in name
    )


def names_hub_id(name: str) -> bool:
    """Whether `name` reaches the hub as a hub id (`_resolve_source`'s last case): not a pretrained
    preset's name, not an existing path, not a string that can only mean a local path."""
    return name not in PRETRAINED and not Path(name).expanduser().exists() and not _looks_local(name)


def source_problem(name: str, key: str, *, need_config: bool) -> str | None:
    """Why `name` cannot be a model source, from the file system alone (no torch, no transformers,
    no network): a local-looking path that does not exist, or (with `need_config`) a folder without
    config.json. None for an existing path, a preset's name or a hub id."""
    p = Path(name).expanduser()
    if p.exists():
        if need_config and p.is_dir() and not (p / "config.json").is_file():
            return f"{key} {name!r}: the folder has no config.json, so it is not a Hugging Face model folder"
        return None
    if name not in PRETRAINED and _looks_local(name):
        return (
            f"{key} {name!r}: no such file or folder (looked for {p.resolve()}). Build a tiny one with "
            "`scaletune init-model olmo2-tiny -o PATH`, or give a hub id like owner/name."
        )
    return None


def local_config_json(name: str) -> dict | None:
    """The config.json of a local model folder read as plain JSON (no transformers, so no class
    defaults filled in), or None: not a local folder, or no readable JSON mapping there."""
    path = Path(name).expanduser() / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _resolve_source(name: str, key: str, *, need_config: bool, revision: str | None = None) -> str:
    """The path or hub id to hand to `from_pretrained`: an existing path as given, a pretrained
    preset's name (`smollm2-135m-instruct`) as its cached folder (fetched on first use), a hub id
    the shared hub cache holds (`shared_snapshot`) as its folder there, else the hub id (whose
    download then refuses a hub answer that names a path: `guard_hub_answers`).

    Raises:
        UserError: a local-looking path that does not exist, or a folder without config.json.
        RuntimeError: a pretrained preset that could not be fetched.
    """
    p = Path(name).expanduser()
    if name in PRETRAINED and not p.exists():
        return str(pretrained_path(name))
    problem = source_problem(name, key, need_config=need_config)
    if problem is not None:
        raise UserError(problem, title="model not found" if not p.exists() else "invalid model")
    if p.exists():
        return str(p)
    snapshot = shared_snapshot(name, revision, need_config=need_config)
    if snapshot is not None:
        log.info("%s %s: the service's copy in its shared hub cache (%s)", key, name, snapshot)
        return str(snapshot)
    guard_hub_answers()
    return name


def _hub_failure(key: str, name: str, exc: Exception) -> UserError:
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, HostileHubAnswer):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:  # transformers rewords it as "can't load"; the refusal says what happened
        return UserError(f"{key} {name!r}: {cause}", title="model not found")
    offline = any(
        os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )
    hint = (
        " The hub is switched off here (HF_HUB_OFFLINE): only models already in the cache can be used."
        if offline
        else " Check the id, `huggingface-cli login` for gated models, and the network."
    )
    return UserError(
        f"{key} {name!r}: not a local folder, and loading it from the Hugging Face hub failed: "
        f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}.{hint}",
        title="model not found",
    )


def _remote_code_error(key: str, name: str, exc: Exception) -> UserError:
    return UserError(
        f"{key} {name!r} needs custom Python code from the model's files (config.json `auto_map`), "
        "which scaletune does not run unless asked. Read that code, then set "
        "model.trust_remote_code: true if you trust it.",
        title="remote code refused",
    )


def _is_remote_code_refusal(exc: Exception) -> bool:
    return "trust_remote_code" in str(exc)


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of `cfg.tokenizer` (default: `cfg.name_or_path`).

    A tokenizer without a pad token gets its EOS token as pad (labels of padding positions are
    masked by the data layer, so this does not teach the model to stop early); padding is on
    the right, as causal-LM training with position ids from 0 expects.

    Raises:
        UserError: the path is missing, the tokenizer needs custom code that was not allowed,
            it cannot be loaded from the hub, or it has neither a pad nor an EOS token.
    """
    from transformers import AutoTokenizer

    key = "model.tokenizer" if cfg.tokenizer else "model.name_or_path"
    name = cfg.tokenizer or cfg.name_or_path
    source = _resolve_source(name, key, need_config=False, revision=cfg.revision)
    try:
        tok = AutoTokenizer.from_pretrained(
            source, trust_remote_code=bool(cfg.trust_remote_code), revision=cfg.revision
        )
    except ValueError as exc:
        if _is_remote_code_refusal(exc):
            raise _remote_code_error(key, name, exc) from exc
        raise
    except OSError as exc:
        if source == name and not Path(name).exists():
            raise _hub_failure(key, name, exc) from exc
        raise UserError(f"{key} {name!r}: cannot load a tokenizer from it: {exc}", title="invalid tokenizer") from exc
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise UserError(
                f"{key} {name!r}: the tokenizer has neither a pad nor an EOS token", title="invalid tokenizer"
            )
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def model_processor(cfg: ModelConfig) -> Any:
    """The processor of `cfg`'s model when it is a vision-language model
    (`models.vision.load_processor`), else None: its tokenizer renders its data.

    Raises:
        UserError: what :func:`load_config` and `load_processor` raise.
    """
    from scaletune.models.vision import is_vision_language, load_processor

    return load_processor(cfg) if is_vision_language(load_config(cfg)) else None


def torch_dtype(name: str) -> torch.dtype:
    """THE map from a dtype name (`bfloat16`, `uint8`: torch's own names) to the torch dtype.

    Raises:
        ValueError: torch has no dtype of that name.
    """
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def bnb_config(q: QuantizationConfig) -> Any:
    """The `transformers.BitsAndBytesConfig` for `model.quantization`, after checking the
    environment can run it.

    4-bit: NF4 or FP4 weights, optional double quantization (QLoRA, Dettmers et al. 2023),
    compute in `compute_dtype`, packed weights stored as `storage_dtype` (FSDP / ZeRO-3 flatten
    them with the other parameters, whose dtype it must equal). 8-bit: LLM.int8().

    Raises:
        RuntimeError: no CUDA GPU (checked before bitsandbytes is imported), or bitsandbytes is
            not installed.
    """
    import importlib.util

    import torch

    what = f"model.quantization asks for {q.bits}-bit bitsandbytes weights" + (
        f" ({q.quant_type})" if q.bits == 4 else ""
    )
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what}, but bitsandbytes k-bit quantization needs a CUDA GPU and none is visible here. "
            "Drop model.quantization (train the LoRA adapter on unquantized weights) or run on a GPU machine."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RuntimeError(f"{what}, but bitsandbytes is not installed: pip install 'scaletune[gpu]'")
    from transformers import BitsAndBytesConfig

    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=torch_dtype(q.compute_dtype),
        bnb_4bit_quant_storage=torch_dtype(q.storage_dtype),
    )


def load_config(cfg: ModelConfig) -> PretrainedConfig:
    """The model's `transformers` config: from its folder or the hub, or a preset's by name.

    A preset name (`llama-3-8b`) is accepted where no such path exists, so the planner can work
    from a shape alone.

    Raises:
        UserError: missing path, custom code not allowed, hub failure.
    """
    from transformers import AutoConfig

    name = cfg.name_or_path
    if name in PRESETS and not Path(name).exists():
        return PRESETS[name].config()
    source = _resolve_source(name, "model.name_or_path", need_config=True, revision=cfg.revision)
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=bool(cfg.trust_remote_code), revision=cfg.revision)
    except ValueError as exc:
        if _is_remote_code_refusal(exc):
            raise _remote_code_error("model.name_or_path", name, exc) from exc
        raise
    except OSError as exc:
        if source == name and not Path(name).exists():
            raise _hub_failure("model.name_or_path", name, exc) from exc
        raise


def load_model(cfg: ModelConfig, placement: DevicePlacement, *, meta: bool = False) -> torch.nn.Module:
    """Load the causal LM of `cfg` through `AutoModelForCausalLM.from_pretrained` (a vision-language
    model through `AutoModelForImageTextToText`: :func:`auto_class`).

    `dtype` (float32 / bfloat16 / float16 / auto: the checkpoint's), `attn_implementation`,
    `revision` and `trust_remote_code` (passed as given, False by default: custom code in a
    checkpoint is never run unless the config says so) come from `cfg`; `device_map` from
    `placement`. Without a device_map the model is moved to `placement.device`; a CUDA device
    is passed as `device_map={"": device}` so each rank streams the weights straight to its GPU
    rather than holding a full copy in host memory first.

    With `meta=True` the architecture is built from the config alone on the meta device (no
    weights read, no storage allocated): FSDP materialises it shard by shard and the planner
    counts its parameters. Quantization is ignored there (the planner accounts for it itself).

    Raises:
        UserError: missing local path (never sent to the hub), folder without config.json,
            custom code not allowed, hub failure.
        RuntimeError: quantization asked without a CUDA GPU or without bitsandbytes.
    """
    if cfg.attn_implementation == "flex_attention":
        from scaletune.models.attention import use_autocast_flex_attention

        use_autocast_flex_attention()  # queries and keys arrive fp32 under autocast (see there)
    if meta:
        return _meta_model(cfg)

    name = cfg.name_or_path
    source = _resolve_source(name, "model.name_or_path", need_config=True, revision=cfg.revision)
    kwargs: dict[str, Any] = {
        "dtype": "auto" if cfg.dtype == "auto" else torch_dtype(cfg.dtype),
        "trust_remote_code": bool(cfg.trust_remote_code),
        "revision": cfg.revision,
    }
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    zero3 = _zero3_announced()
    if cfg.quantization is not None:
        kwargs["quantization_config"] = bnb_config(cfg.quantization)
    device_map, own_map = _device_map(cfg, placement, zero3)
    if device_map is not None:
        kwargs["device_map"] = device_map
    if placement.message:
        log.info(placement.message)
    auto = auto_class(load_config(cfg))
    try:
        with no_load_bars():
            model = auto.from_pretrained(source, **kwargs)
    except ValueError as exc:
        if _is_remote_code_refusal(exc):
            raise _remote_code_error("model.name_or_path", name, exc) from exc
        raise
    except OSError as exc:
        if source == name and not Path(name).exists():
            raise _hub_failure("model.name_or_path", name, exc) from exc
        raise
    if zero3:
        pass  # partitioned by zero.Init, or (quantized) loaded whole onto this rank's GPU
    elif device_map is None:
        model.to(placement.device)
    elif own_map and cfg.quantization is None and hasattr(model, "hf_device_map"):
        # A one-device map we added only to load straight onto the GPU: drop the attribute, or
        # HF Trainer / accelerate would treat the model as dispatched by a user's device_map.
        del model.hf_device_map
    return model


def _device_map(cfg: ModelConfig, placement: DevicePlacement, zero3: bool) -> tuple[dict | str | None, bool]:
    """The `device_map` for `from_pretrained`, and whether it is one scaletune added (a one-device
    map to load straight onto the GPU) rather than the user's.

    Under ZeRO-3 announced (strategies.deepspeed) none: from_pretrained builds the model partitioned
    under deepspeed.zero.Init, where ZeRO places each partition, and a device_map or a .to() would
    undo it. A quantized model under ZeRO-3 gets none either: transformers skips zero.Init for it and
    loads it whole on this rank's GPU, and deepspeed.initialize partitions it (QLoRA under ZeRO-3,
    the 4-bit weights stored as model.dtype: resolve.rules). transformers refuses any device_map
    while ZeRO-3 is announced (`check_and_set_device_map`, integrations/accelerate.py, 5.17 and
    5.24), and its bitsandbytes quantizer then loads onto `torch.cuda.current_device()`
    (`update_device_map`), the rank's GPU since the process group's setup
    (strategies/process_group.py)."""
    import torch

    if zero3:
        return None, False
    device_map = placement.device_map
    if device_map is not None:
        return device_map, False
    if cfg.quantization is not None:
        # bitsandbytes quantizes while loading onto the GPU; a quantized model cannot be moved
        # with .to() afterwards, so it must be loaded where it will run.
        device = placement.device if placement.device.startswith("cuda") else f"cuda:{torch.cuda.current_device()}"
        return {"": device}, True
    if placement.device.startswith("cuda"):
        return {"": placement.device}, True
    return None, False


def _zero3_announced() -> bool:
    """True while a DeepSpeed ZeRO-3 config is announced to transformers (`HfDeepSpeedConfig`)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


def auto_class(config: PretrainedConfig) -> Any:
    """`AutoModelForImageTextToText` for a vision-language model (`models.vision`), else
    `AutoModelForCausalLM`.

    Raises:
        UserError: a vision-language architecture scaletune does not fine-tune (the message lists those it does).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from scaletune.models.vision import is_vision_language, vision_problem

    if not is_vision_language(config):
        return AutoModelForCausalLM
    problem = vision_problem(config)
    if problem is not None:
        raise UserError(problem, title="unsupported model")
    return AutoModelForImageTextToText


def _meta_model(cfg: ModelConfig) -> torch.nn.Module:
    import torch

    config = load_config(cfg)
    auto = auto_class(config)
    kwargs: dict[str, Any] = {"trust_remote_code": bool(cfg.trust_remote_code)}
    if cfg.dtype != "auto":
        kwargs["dtype"] = torch_dtype(cfg.dtype)
    elif getattr(config, "dtype", None) is None:
        kwargs["dtype"] = torch.float32
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    with torch.device("meta"):
        try:
            return auto.from_config(config, **kwargs)
        except (ImportError, ValueError) as exc:
            if "attn_implementation" not in kwargs or _is_remote_code_refusal(exc):
                raise
            # flash_attention_2 and friends check their kernels at construction; the shape does
            # not depend on them, so a planner on a machine without the kernel still works.
            log.info(
                f"attn_implementation {cfg.attn_implementation} unavailable here ({exc}); building with the default"
            )
            kwargs.pop("attn_implementation")
            return auto.from_config(config, **kwargs)
