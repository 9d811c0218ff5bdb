"""Nothing from a checkpoint is unpickled except by a restricted unpickler that admits only the
classes the formats scaletune reads really write (threat model: docs/security.md).

* Every `torch.load` in a scaletune process, also inside DeepSpeed (its checkpoint engine,
  `ds_to_universal`, `zero_to_fp32`, which pass `weights_only=False`) and inside DCP's load
  planner, runs PyTorch's `weights_only` unpickler: :func:`enforce` sets torch's own switch
  `TORCH_FORCE_WEIGHTS_ONLY_LOAD=1` (inherited by the ranks and DeepSpeed's workers) and adds
  DeepSpeed's few plain-data classes to torch's allow-list.
* DCP's `.metadata` is a plain pickle that `FileSystemReader.read_metadata` loads with
  plain `pickle`: :class:`SafeFileSystemReader` reads it with :func:`restricted_unpickle` (the
  "restricting globals" pattern of the `pickle` documentation) instead.
* :func:`verify_checkpoint` scans a checkpoint before any engine touches it: the globals of every
  `torch.save` file (statically, with torch's `get_unsafe_globals_in_checkpoint`: no tensor data
  is read), the metadata and DCP's pickled entries, so a hostile file is refused with exit 2,
  naming the file and the global, and never reaches `pickle`.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from scaletune.errors import UserError

FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


class UnsafeCheckpointError(UserError):
    """A checkpoint file the restricted unpickler refuses (exit 2: bad input)."""


def torch_save_globals() -> list[Any]:
    """Beyond torch's own allow-list (tensors, storages, dtypes, containers): the plain-data classes
    DeepSpeed's optimizer states hold (found in real ZeRO-1/2/3 and offload checkpoints)."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:
        return []
    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def enforce(*, deepspeed: bool = True) -> None:
    """Make every `torch.load` of this process and its children restricted (see the module docstring).
    `deepspeed=False` leaves DeepSpeed's classes off torch's allow-list (and DeepSpeed unimported),
    for a process that loads no DeepSpeed file (`train --check`, a run of another engine): the scans
    and :func:`restricted_load` add them themselves."""
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    os.environ[FORCE] = "1"
    if deepspeed:
        _allow_deepspeed_globals()


def _allow_deepspeed_globals() -> None:
    # Added for the life of the process, never through torch's `safe_globals` context manager:
    # leaving it removes its globals even where `enforce` had added them, and DeepSpeed's own
    # loads that follow a scan would then be refused.
    torch.serialization.add_safe_globals(torch_save_globals())


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> object for DCP's `.metadata`: its dataclasses, an enum, torch.Size, the
    layout decoder and a path (found in real single, DDP and FSDP checkpoints)."""
    import collections
    import pathlib

    from torch.distributed.checkpoint import filesystem as dcp_fs
    from torch.distributed.checkpoint import metadata as dcp_meta

    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_fs._StorageInfo,
        ("pathlib", "PosixPath"): pathlib.PosixPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("collections", "OrderedDict"): collections.OrderedDict,
    }
    names = ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata")
    for name in (*names, "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"):
        allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(dcp_meta, name)
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    """`find_class` admits only :func:`_metadata_globals` and torch dtypes; no persistent ids."""

    allowed: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        obj = self.allowed.get((module, name))
        if obj is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            obj = getattr(torch, name)
        if obj is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed")


def restricted_unpickle(data: bytes, source: str) -> Any:
    """Unpickle a plain pickle stream (DCP's `.metadata`) admitting only the globals that format
    writes. (torch's weights_only unpickler reads pickle protocol 2 only; DCP writes protocol 4.)

    Raises:
        UnsafeCheckpointError: naming `source` and the refused global.
    """
    unpickler = _RestrictedUnpickler(io.BytesIO(data))
    unpickler.allowed = _metadata_globals()
    try:
        return unpickler.load()
    except (pickle.UnpicklingError, AttributeError, ValueError, EOFError, TypeError, IndexError, KeyError) as exc:
        raise _refusal(source, exc) from None


def restricted_load(
    path: str | Path | io.BytesIO, map_location: Any = "cpu", source: str | None = None, *, mmap: bool = False
) -> Any:
    """`torch.load(..., weights_only=True)` with DeepSpeed's plain-data classes allowed; `mmap`:
    tensors map the file and are read when touched (a caller that wants a few tensors of a large
    file reads only those).

    Raises:
        UnsafeCheckpointError: a global outside the allow-list, or not a readable `torch.save` file.
    """
    _allow_deepspeed_globals()
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, ValueError, EOFError, OSError) as exc:
        raise _refusal(source or str(path), exc) from None


def _refusal(source: str, exc: Exception) -> UnsafeCheckpointError:
    lines = str(exc).strip().splitlines()
    detail = next(
        (x.strip() for x in lines if "GLOBAL" in x or "global" in x), lines[0] if lines else type(exc).__name__
    )
    return UnsafeCheckpointError(
        f"{source}: refused by the restricted unpickler ({detail[:300]}); scaletune loads only tensors and the "
        "plain data its checkpoint formats write (docs/security.md). Do not load this file with pickle.",
        title="unsafe or corrupt checkpoint",
    )


def _pickle_files(root: Path) -> Iterator[tuple[Path, str]]:
    """(file, kind) for every file under `root` read through a pickle: `zip` for `torch.save`
    files, `pickle` for DCP metadata. Links are refused by the caller, not followed."""
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        if path.name.endswith(".metadata"):
            yield path, "pickle"
        elif path.suffix in (".pt", ".bin", ".pth", ".ckpt"):
            yield path, "zip"


def scan_torch_file(path: Path) -> None:
    """Refuse a `torch.save` file that names a global outside the allow-list, statically (torch's
    `get_unsafe_globals_in_checkpoint` reads only its pickle, no tensor data, and runs nothing).

    Raises:
        UnsafeCheckpointError: naming the file and the globals, or saying it is not a torch file.
    """
    _allow_deepspeed_globals()
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as exc:  # noqa: BLE001 - any parse failure means: not a file we load
        raise _refusal(str(path), exc) from None
    if unsafe:
        raise _refusal(str(path), ValueError(f"GLOBAL {', '.join(sorted(unsafe))} is not allowed"))


def verify_checkpoint(root: Path) -> int:
    """Scan every pickle-bearing file under `root` without running any of its code.

    Returns:
        The number of files checked.

    Raises:
        UnsafeCheckpointError: the first file that names a global outside the allow-list, is not
            a `torch.save` file, or is a symbolic link.
    """
    n = 0
    for path in root.rglob("*"):
        if path.is_symlink():
            raise UnsafeCheckpointError(
                f"{path}: a symbolic link inside a checkpoint; refused", title="unsafe or corrupt checkpoint"
            )
    for path, kind in _pickle_files(root):
        if kind == "pickle":
            meta = restricted_unpickle(path.read_bytes(), str(path))
            _verify_dcp_bytes(path.parent, meta)
        else:
            scan_torch_file(path)
        n += 1
    return n


def _verify_dcp_bytes(folder: Path, meta: Any) -> None:
    """DCP's pickled (non-tensor) entries, through the restricted `torch.load`."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    entries = getattr(meta, "state_dict_metadata", None) or {}
    storage = getattr(meta, "storage_data", None)
    if not isinstance(storage, dict):
        raise UnsafeCheckpointError(f"{folder}/.metadata: no storage index", title="unsafe or corrupt checkpoint")
    # storage_data is keyed by MetadataIndex (fqn, offset, index); state_dict_metadata by fqn.
    for index, info in storage.items():
        if not isinstance(entries.get(getattr(index, "fqn", None)), BytesStorageMetadata):
            continue
        shard = folder / str(info.relative_path)
        if not shard.resolve().is_relative_to(folder.resolve()):
            raise UnsafeCheckpointError(
                f"{folder}: an entry points outside the checkpoint ({info.relative_path})",
                title="unsafe or corrupt checkpoint",
            )
        need, size = info.offset + info.length, shard.stat().st_size if shard.is_file() else 0
        if size < need:
            raise UnsafeCheckpointError(
                f"{shard}: truncated ({size:,} bytes, its entries need {need:,})", title="unsafe or corrupt checkpoint"
            )
        with open(shard, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        restricted_load(io.BytesIO(blob), source=f"{shard} ({index.fqn})")


def dcp_reader(path: Path) -> Any:
    """A DCP `FileSystemReader` of `path` whose metadata goes through :func:`restricted_unpickle`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            meta_path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(meta_path, "rb") as f:
                metadata = restricted_unpickle(f.read(), str(meta_path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))
