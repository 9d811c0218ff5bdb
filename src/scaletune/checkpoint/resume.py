"""Resuming: which checkpoint `training.resume` means, and whether it can be resumed, checked whole
before anything is written (every file present and parseable, nothing outside the restricted
unpickler's allow-list, the same model); then the shapes, before loading, and the RNG states."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from scaletune.checkpoint.save import FORMAT_VERSION, LATEST, Progress, latest_checkpoint, set_rng_state
from scaletune.config import Config, error_messages, read_config
from scaletune.errors import Problem, UserError
from scaletune.safe_load import (
    UnsafeCheckpointError,
    dcp_reader,
    restricted_load,
    restricted_unpickle,
    verify_checkpoint,
)

_FORMATS = ("dcp", "deepspeed")


def _problem(message: str) -> Problem:
    """A problem with a checkpoint's files (the message names the file)."""
    return Problem("checkpoint", None, message)


def _read_json(path: Path, problems: list[Problem]) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        problems.append(_problem(f"{path}: missing"))
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(_problem(f"{path}: cannot be read: {exc}"))
    except json.JSONDecodeError as exc:
        problems.append(_problem(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}"))
    return None


def read_progress(path: Path) -> Progress:
    """`progress.json` of a checkpoint, validated field by field.

    Raises:
        UserError: missing, not JSON, a field missing or of the wrong type, another format version.
    """
    progress, problems = _progress(path)
    if problems:
        raise UserError(problems, title="corrupt checkpoint")
    assert progress is not None
    return progress


def _progress(path: Path) -> tuple[Progress | None, list[Problem]]:
    """`progress.json` of the checkpoint `path` (None where it cannot be read), and its problems."""
    problems: list[Problem] = []
    data = _read_json(path / "progress.json", problems)
    progress = None
    if data is not None:
        try:
            progress = TypeAdapter(Progress).validate_python(data)
        except ValidationError as exc:
            problems += [_problem(f"{path / 'progress.json'}: {m}") for m in error_messages(exc)]
    if progress is not None and progress.version != FORMAT_VERSION:
        problems.append(
            _problem(
                f"{path / 'progress.json'}: format version {progress.version}; this scaletune reads {FORMAT_VERSION}"
            )
        )
    if progress is not None and progress.checkpoint_format not in _FORMATS:
        problems.append(_problem(f"{path / 'progress.json'}: unknown checkpoint_format {progress.checkpoint_format!r}"))
    return (progress if not problems else None), problems


def checkpoint_problems(path: Path) -> list[Problem]:
    """Everything wrong with a checkpoint folder that can be known without the model: its files
    present and parseable, every pickle-bearing file through the restricted scan, every DCP shard
    long enough for the entries it holds. Reads no tensor data."""
    progress, problems = _progress(path)
    if not isinstance(_read_json(path / "scheduler.json", problems), dict | type(None)):
        problems.append(_problem(f"{path / 'scheduler.json'}: not a JSON object"))
    saved = path / "config.yaml"
    if not saved.is_file():
        problems.append(_problem(f"{saved}: missing"))
    else:
        problems += [_problem(f"saved config {p}") for p in read_config(saved).problems]
    try:
        verify_checkpoint(path)
    except UnsafeCheckpointError as exc:
        problems += [_problem(p) for p in exc.problems]
        return problems
    if progress is not None and progress.checkpoint_format == "dcp":
        problems += _dcp_problems(path / "state")
    elif progress is not None and not any((path / "deepspeed" / "state").glob("*.pt")):
        problems.append(_problem(f"{path / 'deepspeed' / 'state'}: no DeepSpeed state files"))
    return problems


def _dcp_problems(state: Path) -> list[Problem]:
    meta_path = state / ".metadata"
    if not meta_path.is_file():
        return [_problem(f"{meta_path}: missing")]
    meta = restricted_unpickle(meta_path.read_bytes(), str(meta_path))
    sizes: dict[str, int] = {}
    for info in (getattr(meta, "storage_data", None) or {}).values():
        name = str(info.relative_path)
        sizes[name] = max(sizes.get(name, 0), info.offset + info.length)
    out = []
    for name, need in sorted(sizes.items()):
        f = state / name
        if not f.is_file():
            out.append(_problem(f"{f}: missing (the checkpoint's metadata names it)"))
        elif f.stat().st_size < need:
            out.append(_problem(f"{f}: truncated ({f.stat().st_size:,} bytes, its entries need {need:,})"))
    return out


def resolve_resume(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint to resume from for `training.resume`, or None to start fresh; checked whole
    (:func:`checkpoint_problems`) and against the config (:func:`incompatible_changes`).

    Raises:
        UserError: a path that does not exist or is not a checkpoint; a corrupt or unsafe
            checkpoint; one whose model or LoRA settings differ from the config.
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
    problems = checkpoint_problems(path)
    if not problems:
        saved = read_config(path / "config.yaml").config
        assert saved is not None
        problems = [_problem(f"{path}: {p}") for p in incompatible_changes(saved.model_dump(mode="json"), cfg)]
    if problems:
        raise UserError(problems, title="cannot resume")
    return path


def incompatible_changes(saved: dict, cfg: Config) -> list[str]:
    """Config changes a checkpoint cannot survive: another model (or model factory and arguments) or
    another LoRA shape."""
    now = cfg.model_dump(mode="json")
    out = []
    for key in ("name_or_path", "factory", "factory_kwargs"):
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


def read_scheduler_state(path: Path) -> dict:
    """The learning-rate schedule's state a checkpoint saved (`scheduler.json`, checked by
    :func:`checkpoint_problems` before the run started)."""
    return json.loads((path / "scheduler.json").read_text())


def check_shapes(path: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """Compare a DCP checkpoint's tensor shapes with the model's before loading.

    Raises:
        UserError: naming the first tensor whose shape differs, or one the model lacks.
    """
    if not (path / "state").is_dir():
        return
    meta = dcp_reader(path / "state").read_metadata().state_dict_metadata
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
    set_rng_state(restricted_load(f))
    return True
