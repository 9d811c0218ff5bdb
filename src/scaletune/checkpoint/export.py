"""Export: a consolidated Hugging Face folder (safetensors) from any checkpoint, sharded or not,
in one process on the CPU, checked whole before anything is written and written atomically."""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

import torch

from scaletune.checkpoint.resume import checkpoint_problems, read_progress
from scaletune.checkpoint.save import latest_checkpoint, single_process_dcp
from scaletune.config import Config, read_config
from scaletune.errors import Problem, UserError
from scaletune.safe_load import dcp_reader, enforce

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*$", re.IGNORECASE)


def _full_state_from_checkpoint(path: Path, module: torch.nn.Module, fmt: str) -> dict[str, torch.Tensor]:
    """The trainable weights of a checkpoint as full tensors keyed like `module`, in one process."""
    if fmt == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # Its torch.load calls run restricted (safe_load.enforce): the files were scanned too.
        state = get_fp32_state_dict_from_zero_checkpoint(str(path / "deepspeed"), tag="state")
        return {**_frozen_from_module_state(path, state.keys()), **state}
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # The weights the checkpoint holds (trainable ones, and frozen ones that trained in an earlier stage).
    reader = dcp_reader(path / "state")
    saved = reader.read_metadata().state_dict_metadata
    full = get_model_state_dict(module, options=StateDictOptions(ignore_frozen_params=False))
    state = {"model": {k: v for k, v in full.items() if f"model.{k}" in saved}}
    with single_process_dcp():
        dcp.load(state, storage_reader=dcp_reader(path / "state"))  # no process group: reads every shard
    return state["model"]


def _frozen_from_module_state(path: Path, held: Iterable[str]) -> dict[str, torch.Tensor]:
    """The weights of a DeepSpeed checkpoint that `zero_to_fp32` leaves out: frozen ones, which
    ZeRO-1 saves only in its module state (DeepSpeed keeps frozen fragments only where it partitions
    gradients, ZeRO-2 and 3: `DeepSpeedEngine._save_checkpoint`, 0.19.8), whole, in the model's
    dtype. A checkpoint holds them when an earlier stage trained a weight its stage freezes
    (strategies/deepspeed.py `save_state`); without them an export would give those weights the
    values the model was loaded with. ZeRO-3's module state is placeholders (empty) and is skipped;
    the resume reads the same file (`DeepSpeedStrategy._load_frozen_weights`)."""
    from scaletune.safe_load import restricted_load

    files = sorted((path / "deepspeed" / "state").glob("mp_rank_*_model_states.pt"))
    if not files:
        return {}
    # Mapped, not read: the module state of a ZeRO-1/2 run holds every trainable weight as well
    # (zero_to_fp32 has those in fp32), and only the ones it lacks are read.
    module = restricted_load(files[0], mmap=True).get("module") or {}
    held = set(held)
    return {k: v.clone() for k, v in module.items() if k not in held and isinstance(v, torch.Tensor) and v.numel() > 0}


def export_problems(checkpoint: Path, out_dir: Path, max_shard_size: str) -> list[Problem]:
    """What stops an export, found before any model loads or anything is written."""
    problems: list[Problem] = []
    if not _SIZE.match(max_shard_size):
        problems.append(_option(f"--max-shard-size {max_shard_size!r}: give a size such as 5GB, 500MB or 2GiB"))
    if out_dir.exists() and not out_dir.is_dir():
        problems.append(_option(f"-o {out_dir}: exists and is not a folder"))
    elif out_dir.is_dir() and any(out_dir.iterdir()):
        problems.append(_option(f"output folder {out_dir} is not empty"))
    parent = out_dir.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        problems.append(_option(f"-o {out_dir}: cannot create it under {parent} (not a writable folder)"))
    if not (checkpoint / "progress.json").is_file():
        problems.append(Problem("checkpoint", None, f"{checkpoint} is not a checkpoint (no progress.json)"))
    else:
        problems += checkpoint_problems(checkpoint)
    return problems


def _option(message: str) -> Problem:
    """A problem with an export option (a command-line flag: no config key)."""
    return Problem("export options", None, message)


def export_checkpoint(
    checkpoint: Path,
    out_dir: Path,
    *,
    merge_lora: bool = False,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    allow_factory: bool = False,
    trust_remote_code: bool = False,
    verify: bool = False,
) -> Path:
    """Write a consolidated Hugging Face folder (safetensors, sharded into `max_shard_size` files)
    from any checkpoint, sharded or not, in one process on the CPU. The folder is written under a
    temporary name and renamed into place: an export that fails leaves nothing behind.

    Args:
        checkpoint: a `checkpoints/step-N` folder, or a run directory (its latest checkpoint).
        merge_lora: fold the LoRA adapter into the base weights and write a plain model.
        dtype: "bfloat16" / "float16" / "float32" for the written weights (default: as trained).
        max_shard_size: the largest safetensors file, e.g. "5GB".
        allow_factory: import and call the `model.factory` the checkpoint's `config.yaml` names
            (`--allow-factory`). The checkpoint's config is data that came with it: a name in it
            is not a permission to run that code.
        trust_remote_code: run the model folder's own Python code (`--trust-remote-code`); the
            checkpoint config's `trust_remote_code` is not read, for the same reason.
        verify: before the folder is moved into place, load it in a fresh process through
            transformers (peft for an adapter) and compare its logits on a probe text with the
            model written (:mod:`scaletune.checkpoint.verify`); then, where vLLM is present and
            the folder is a plain model, load it in vLLM and score its greedy continuation of the
            probe (:mod:`scaletune.checkpoint.verify_vllm`). The results go into its README.

    Raises:
        UserError: not a checkpoint, a corrupt or unsafe one; a factory checkpoint without
            `allow_factory`, or with `verify`; an output that exists and is not an empty folder;
            an unreadable shard size.
        RunFailure: `verify` found the folder does not load or compute as written (nothing is left).
    """
    from scaletune.checkpoint.card import checkpoint_source, model_card
    from scaletune.data import trained_chat_template
    from scaletune.models import DevicePlacement, load_tokenizer, prepare_model
    from scaletune.models.adapters import save_adapter, trained_base_weights
    from scaletune.models.loading import model_processor, torch_dtype
    from scaletune.models.loss import CausalLMLoss
    from scaletune.resolve import resolve_stages

    enforce()
    checkpoint = Path(checkpoint)
    if (checkpoint / "checkpoints").is_dir():
        checkpoint = latest_checkpoint(checkpoint) or checkpoint
    problems = export_problems(checkpoint, out_dir, max_shard_size)
    if problems:
        raise UserError(problems, title="cannot export")
    progress = read_progress(checkpoint)
    cfg = read_config(checkpoint / "config.yaml").config
    assert cfg is not None  # checkpoint_problems read it
    if cfg.model.factory is not None:
        if not allow_factory:
            raise UserError(
                f"{checkpoint / 'config.yaml'} names model.factory {cfg.model.factory!r}: exporting it imports and "
                "calls that code. A checkpoint's config came with the checkpoint, so scaletune does not run what "
                "it names on its own say: read that code, then give --allow-factory",
                title="cannot export",
            )
        if verify:
            raise UserError(
                "--verify loads the export through transformers' AutoModelForCausalLM: a model.factory "
                "checkpoint's export is not one; export without --verify",
                title="cannot export",
            )
        return _export_factory_checkpoint(checkpoint, out_dir, cfg, progress.checkpoint_format)
    model_cfg = cfg.model.model_copy(
        update={
            "trust_remote_code": trust_remote_code,
            "dtype": "float32",
            "device_map": None,
            "gradient_checkpointing": False,
            "liger": False,
            "activation_offload": False,
        }
    )
    model = prepare_model(model_cfg, DevicePlacement(device_map=None, device="cpu", message=None))
    module = CausalLMLoss(model)
    lora = cfg.model.lora is not None
    # Under LoRA, the base weights the checkpoint holds with other values than the base's trained
    # beside the adapters (a stage's `trainable`): the adapter folder carries them (save_adapter).
    # One it holds unchanged (DCP keeps a frozen head tied to the embeddings) would only repeat the
    # base's. DCP loads into the module's own tensors, so the base's values of the weights it holds
    # are copied first (only those: a copy of the whole base would double the export's memory).
    own = module.state_dict() if lora else {}
    names = trained_base_weights(model, [k.removeprefix("causal_lm.") for k in own]) if lora else []
    if progress.checkpoint_format == "deepspeed":  # zero_to_fp32 reads into new tensors
        base = {k: own[k] for k in (f"causal_lm.{n}" for n in names)}
    else:
        saved = dcp_reader(checkpoint / "state").read_metadata().state_dict_metadata
        base = {k: own[k].detach().clone() for k in (f"causal_lm.{n}" for n in names) if f"model.{k}" in saved}
    state = _full_state_from_checkpoint(checkpoint, module, progress.checkpoint_format)
    trained_base = [k.removeprefix("causal_lm.") for k in state if k in base and not torch.equal(base[k], state[k])]
    del base
    result = module.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise UserError(f"{checkpoint}: tensor {result.unexpected_keys[0]} is not in the model", title="cannot export")
    if lora and merge_lora:
        model = model.merge_and_unload()
    if dtype:
        model = model.to(torch_dtype(dtype))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.export-{uuid.uuid4().hex[:8]}"
    try:
        if lora and not merge_lora:
            save_adapter(model, tmp, trained_base=trained_base)
        else:
            model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
        tokenizer = load_tokenizer(cfg.model.model_copy(update={"trust_remote_code": trust_remote_code}))
        template = trained_chat_template((st.data for st in resolve_stages(cfg)), tokenizer)
        if template is not None:  # as final/ carries it: the model is prompted as it was trained
            tokenizer.chat_template = template
        processor = model_processor(model_cfg)
        # A vision-language model's processor (image processor, tokenizer, chat template), as final/ holds it.
        (processor or tokenizer).save_pretrained(str(tmp))
        kind = "adapter" if lora and not merge_lora else "model"
        source, run_dir = checkpoint_source(checkpoint)
        card = model_card(
            cfg, source=source, run_dir=run_dir, step=progress.step, kind=kind, folder=out_dir.name, merged=merge_lora
        )
        if verify:
            from scaletune.checkpoint.verify import readme_section, verify_folder
            from scaletune.checkpoint.verify_vllm import not_checked, verify_vllm, vllm_python

            adapter = kind == "adapter"
            checks = [
                lambda: verify_folder(tmp, model, tokenizer, adapter=adapter, trust_remote_code=trust_remote_code)
            ]
            python = vllm_python()
            why = not_checked(python, adapter=adapter, vision=processor is not None, remote_code=trust_remote_code)
            if python is not None and why is None:  # after transformers' check: it reads the dtype written
                checks.append(lambda: verify_vllm(tmp, model, tokenizer, python))
            card += readme_section(*checks, notes=[] if why is None else [f"export --verify: {why}"])
        (tmp / "README.md").write_text(card)  # in place of peft's template card for an adapter
        if out_dir.is_dir():
            out_dir.rmdir()  # empty (checked above)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _export_factory_checkpoint(checkpoint: Path, out_dir: Path, cfg: Config, fmt: str) -> Path:
    """A factory run's checkpoint as its `final/` layout (`models.factory.write_export`): the module
    built by the config's factory on the CPU, the checkpoint's weights loaded over it."""
    from scaletune.models.custom import PREFIX, CustomModelLoss
    from scaletune.models.factory import build_model, write_export

    model, processor = build_model(cfg.model.model_copy(update={"gradient_checkpointing": False}), dtype="float32")
    module = CustomModelLoss(model, cfg.model)
    result = module.load_state_dict(_full_state_from_checkpoint(checkpoint, module, fmt), strict=False)
    if result.unexpected_keys:
        raise UserError(f"{checkpoint}: tensor {result.unexpected_keys[0]} is not in the model", title="cannot export")
    state = {k.removeprefix(PREFIX): v for k, v in module.state_dict().items()}
    return write_export(out_dir, state, cfg.model, processor)
