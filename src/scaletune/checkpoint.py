"""Resumable checkpoints: saved atomically, resumed exactly, resharded to another world size,
exported to a Hugging Face folder.

Layout of `checkpoints/step-N/`::

    progress.json      step, stage, epoch, position in the epoch, world size, strategy, format
    scheduler.json     the learning-rate scheduler's state
    config.yaml        the resolved config of the run that wrote it
    rng/rank-R.pt      torch / Python / NumPy RNG states of each rank (weights_only-loadable)
    state/             torch.distributed.checkpoint (DCP): model (trainable weights) + optimizer,
                       one shard file per rank; any world size can load it (DDP, FSDP2, single)
    deepspeed/state/   DeepSpeed's own checkpoint (ZeRO partitions per rank), for strategy deepspeed

Atomicity: every rank writes into `.tmp-step-N/`; rank 0 then flushes it to disk, renames it to
`step-N/` and only then rewrites `latest` (itself through a renamed temporary file). A crash at
any point leaves `latest` naming the previous complete checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from scaletune.config import Config, dump_config
from scaletune.errors import UserError

LATEST = "latest"
FORMAT_VERSION = 1


@dataclass
class Progress:
    """Where a run stands. `sample_offset` = global sequences consumed in the current epoch."""

    step: int  # optimizer steps since the run began
    stage_index: int
    stage_name: str
    stage_step: int  # optimizer steps done in this stage
    epoch: int  # epoch (within the stage) of the next step
    step_in_epoch: int  # steps done in that epoch
    sample_offset: int
    world_size: int
    strategy: str
    checkpoint_format: str
    stage_complete: bool = False
    version: int = FORMAT_VERSION


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def rng_state() -> dict[str, Any]:
    """This process's RNG states as plain tensors, lists and ints (loadable with weights_only)."""
    import numpy as np

    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype("int64")), *np_state[2:]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    version, seq, *rest = state["python"]
    random.setstate((version, tuple(seq), *rest))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """torch.distributed.checkpoint without a process group warns on every save and load that it
    assumes one process. scaletune means exactly that there (a single-process run, or an export that
    reads every shard), and the user can do nothing about it, so that one warning is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_checkpoint(
    strategy: Any,
    run_dir: Path,
    progress: Progress,
    cfg: Config,
    scheduler_state: dict,
    *,
    keep_last: int,
    fail_after_state: bool = False,
) -> Path:
    """Write `checkpoints/step-N` atomically (a collective: every rank calls it).

    Args:
        fail_after_state: raise after the shards are written and before the rename (tests use it to
            show an interrupted save leaves `latest` on the previous checkpoint).

    Returns:
        The checkpoint directory.
    """
    env = strategy.env
    root = checkpoints_dir(run_dir)
    final = root / f"step-{progress.step}"
    tmp = root / f".tmp-step-{progress.step}"
    if env.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)  # a previous attempt that died mid-save
        (tmp / "rng").mkdir(parents=True)
    strategy.barrier()
    with single_process_dcp():
        strategy.save_state(tmp)
    torch.save(rng_state(), tmp / "rng" / f"rank-{env.rank}.pt")
    strategy.barrier()
    if fail_after_state:
        raise RuntimeError("checkpoint save interrupted (injected)")
    if env.is_main:
        (tmp / "progress.json").write_text(json.dumps(asdict(progress), indent=2))
        (tmp / "scheduler.json").write_text(json.dumps(scheduler_state))
        (tmp / "config.yaml").write_text(dump_config(cfg))
        _fsync_tree(tmp)
        if final.exists():  # the same step saved before (a stage end after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_atomic(root / LATEST, final.name + "\n")
        _prune(root, keep_last, keep=final.name)
    strategy.barrier()
    return final


def _prune(root: Path, keep_last: int, keep: str) -> None:
    done = sorted((p for p in root.glob("step-*") if p.is_dir()), key=lambda p: int(p.name.split("-")[1]))
    for old in done[:-keep_last]:
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names, or None when the run has none."""
    pointer = checkpoints_dir(run_dir) / LATEST
    if not pointer.is_file():
        return None
    path = checkpoints_dir(run_dir) / pointer.read_text().strip()
    return path if (path / "progress.json").is_file() else None


def read_progress(path: Path) -> Progress:
    return Progress(**json.loads((path / "progress.json").read_text()))


def resolve_resume(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint to resume from for `training.resume`, or None to start fresh.

    Raises:
        UserError: a path that does not exist or is not a checkpoint; a checkpoint whose model or
            LoRA settings differ from the config.
    """
    resume = cfg.training.resume
    if resume is None:
        return None
    if resume == "auto":
        path = latest_checkpoint(run_dir)
        if path is None:
            return None
    else:
        path = Path(resume)
        if not path.exists():
            raise UserError(f"training.resume: {resume} does not exist", title="cannot resume")
        if (path / LATEST).is_file() or (path / "checkpoints").is_dir():
            # A checkpoints/ folder or a run directory: take its latest.
            path = latest_checkpoint(path.parent if (path / LATEST).is_file() else path) or path
        if not (path / "progress.json").is_file():
            raise UserError(
                f"training.resume: {resume} is not a checkpoint (no progress.json); give a "
                "checkpoints/step-N folder, a run directory, or auto",
                title="cannot resume",
            )
    problems = incompatible_changes(yaml.safe_load((path / "config.yaml").read_text()), cfg)
    if problems:
        raise UserError([f"{path}: {p}" for p in problems], title="cannot resume")
    return path


def incompatible_changes(saved: dict, cfg: Config) -> list[str]:
    """Config changes a checkpoint cannot survive: another model or another LoRA shape."""
    now = cfg.model_dump(mode="json")
    out = []
    for key in ("name_or_path",):
        if saved["model"].get(key) != now["model"].get(key):
            out.append(f"model.{key} changed from {saved['model'].get(key)!r} to {now['model'].get(key)!r}")
    a, b = saved["model"].get("lora"), now["model"].get("lora")
    if (a is None) != (b is None):
        out.append(f"model.lora changed from {a!r} to {b!r} (full fine-tuning and LoRA checkpoints differ)")
    elif a and b:
        for key in ("r", "target_modules", "bias"):
            if a.get(key) != b.get(key):
                out.append(f"model.lora.{key} changed from {a.get(key)!r} to {b.get(key)!r}")
    return out


def check_shapes(path: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """Compare a DCP checkpoint's tensor shapes with the model's before loading.

    Raises:
        UserError: naming the first tensor whose shape differs, or one the model lacks.
    """
    if not (path / "state").is_dir():
        return
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path / "state")).read_metadata().state_dict_metadata
    saved = {k: tuple(v.size) for k, v in meta.items() if k.startswith("model.") and hasattr(v, "size")}
    for name, shape in saved.items():
        if name not in expected:
            raise UserError(
                f"{path}: tensor {name} of the checkpoint is not in the model (another model?)", title="cannot resume"
            )
        if expected[name] != shape:
            raise UserError(
                f"{path}: tensor {name} has shape {list(shape)} in the checkpoint but {list(expected[name])} "
                "in the model (a checkpoint of another model or LoRA rank)",
                title="cannot resume",
            )
    missing = [k for k in expected if k not in saved]
    if missing:
        raise UserError(f"{path}: the checkpoint lacks {missing[0]} (another model?)", title="cannot resume")


def load_rng(path: Path, rank: int) -> bool:
    """Restore this rank's RNG states if the checkpoint has them (it may come from fewer ranks)."""
    f = path / "rng" / f"rank-{rank}.pt"
    if not f.is_file():
        return False
    set_rng_state(torch.load(f, weights_only=True))
    return True


# ---------------------------------------------------------------------------------------------
# Export


def _full_state_from_checkpoint(path: Path, module: torch.nn.Module, fmt: str) -> dict[str, torch.Tensor]:
    """The trainable weights of a checkpoint as full tensors keyed like `module`, in one process."""
    if fmt == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(path / "deepspeed"), tag="state")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = {"model": get_model_state_dict(module, options=StateDictOptions(ignore_frozen_params=True))}
    with single_process_dcp():
        dcp.load(state, checkpoint_id=str(path / "state"))  # no process group: reads every shard
    return state["model"]


def export_checkpoint(
    checkpoint: Path, out_dir: Path, *, merge_lora: bool = False, dtype: str | None = None, max_shard_size: str = "5GB"
) -> Path:
    """Write a consolidated Hugging Face folder (safetensors, sharded into `max_shard_size` files)
    from any checkpoint, sharded or not, in one process on the CPU.

    Args:
        merge_lora: fold the LoRA adapter into the base weights and write a plain model.
        dtype: "bfloat16" / "float16" / "float32" for the written weights (default: as trained).

    Raises:
        UserError: not a checkpoint; an existing non-empty output folder.
    """
    from scaletune.loss import CausalLMLoss
    from scaletune.models import DevicePlacement, load_tokenizer, prepare_model

    checkpoint = Path(checkpoint)
    if (checkpoint / "checkpoints").is_dir():
        checkpoint = latest_checkpoint(checkpoint) or checkpoint
    if not (checkpoint / "progress.json").is_file():
        raise UserError(f"{checkpoint} is not a checkpoint (no progress.json)", title="cannot export")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"output folder {out_dir} is not empty", title="cannot export")
    progress = read_progress(checkpoint)
    cfg = Config.model_validate(yaml.safe_load((checkpoint / "config.yaml").read_text()))
    model_cfg = cfg.model.model_copy(
        update={
            "dtype": "float32",
            "device_map": None,
            "gradient_checkpointing": False,
            "liger": False,
            "activation_offload": False,
        }
    )
    model = prepare_model(model_cfg, DevicePlacement(device_map=None, device="cpu", message=None))
    module = CausalLMLoss(model)
    state = _full_state_from_checkpoint(checkpoint, module, progress.checkpoint_format)
    result = module.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise UserError(f"{checkpoint}: tensor {result.unexpected_keys[0]} is not in the model", title="cannot export")
    lora = cfg.model.lora is not None
    if lora and merge_lora:
        model = model.merge_and_unload()
    if dtype:
        model = model.to({"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype])
    out_dir.mkdir(parents=True, exist_ok=True)
    if lora and not merge_lora:
        model.save_pretrained(str(out_dir))
    else:
        model.save_pretrained(str(out_dir), max_shard_size=max_shard_size)
    load_tokenizer(cfg.model).save_pretrained(str(out_dir))
    return out_dir
