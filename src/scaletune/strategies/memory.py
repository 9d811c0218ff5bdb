"""Measuring what a rank holds, from the real tensors (`memory.json`): each storage counted once,
so views into one flat buffer count the buffer. Each engine says which tensors are its parameters,
gradients and optimizer state (`Strategy.memory_breakdown`); the counting is here."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def _storage_key(t: torch.Tensor) -> tuple | None:
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if t.device.type == "meta" or st.nbytes() == 0:
        return None
    return (t.device.type, t.device.index, st.data_ptr())


def count_bytes(tensors: Iterable[Any], seen: dict) -> int:
    """Bytes of the storages behind `tensors` not yet in `seen` (a DTensor counts its local shard);
    `seen` is updated."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        key = _storage_key(t)
        if key is None or key in seen:
            continue
        seen[key] = True
        total += t.untyped_storage().nbytes()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The optimizer's state tensors and its own parameters (an engine's fp32 master copies)."""
    if optimizer is None:
        return []
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return state + [p for g in optimizer.param_groups for p in g["params"]]


def peak_device_bytes(devices: list[torch.device]) -> int | None:
    """The sum of `torch.cuda.max_memory_allocated(device)` over the CUDA `devices` this rank
    computes on (named, not the current device: a `cuda:1` device_map computes off the current one);
    None without any (CPU)."""
    if not devices:
        return None
    return int(sum(torch.cuda.max_memory_allocated(d) for d in devices))
