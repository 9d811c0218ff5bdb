"""Saving checkpoints atomically, and finding the latest one.

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
any point leaves `latest` naming the previous complete checkpoint. A disk that fills up during the
save (torch then reports `unexpected pos ...` from its zip writer, DCP a `CheckpointException`)
ends the run with :class:`DiskFull`: the folder, the bytes a checkpoint takes against those free,
and the intact checkpoint `latest` still names.
"""

from __future__ import annotations

import contextlib
import errno
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

from scaletune.config import Config, dump_config
from scaletune.errors import RunFailure

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


class DiskFull(RunFailure):
    """The disk filled up while a checkpoint was written (exit 1; the previous checkpoint is intact)."""


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

    Raises:
        DiskFull: the disk filled up during the save (the partial folder removed, `latest` intact).
    """
    root = checkpoints_dir(run_dir)
    try:
        return _save(strategy, root, progress, cfg, scheduler_state, keep_last, fail_after_state)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        full = None
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            full = _disk_full(exc, root, root / f".tmp-step-{progress.step}", strategy.env.is_main)
        if full is None:
            raise
        raise full from exc


def _save(
    strategy: Any,
    root: Path,
    progress: Progress,
    cfg: Config,
    scheduler_state: dict,
    keep_last: int,
    fail_after_state: bool,
) -> Path:
    env = strategy.env
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


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _says_disk_full(exc: BaseException) -> bool:
    """True when `exc`, or what caused it, is the OS saying the disk is full."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _disk_full(exc: BaseException, root: Path, tmp: Path, is_main: bool) -> DiskFull | None:
    """The error to end the run with when `exc` came from a full disk, else None.

    A full disk is what `exc` says, or the disk holding `root` having less room than a checkpoint
    takes (the intact `latest`, measured once; 1 MiB without one): torch's zip writer reports a short
    write as `unexpected pos` with no errno. Rank 0 removes the partial folder `tmp` first, so the
    message gives the room there is after it."""
    latest = latest_checkpoint(root.parent)
    needed = _tree_bytes(latest) if latest is not None else 1 << 20
    if not _says_disk_full(exc) and shutil.disk_usage(root).free >= needed:
        return None
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    free = shutil.disk_usage(root).free
    need = f"a checkpoint takes {needed / 2**20:.1f} MiB ({latest.name}), " if latest else ""
    intact = (
        f"the last intact checkpoint is {latest} (resume from it with training.resume: auto once there is room)"
        if latest
        else "no checkpoint of this run is intact"
    )
    return DiskFull(
        f"the disk is full: writing the checkpoint under {root} failed; {need}{free / 2**20:.1f} MiB are free "
        f"after removing the partial {tmp.name}; {intact}"
    )


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
