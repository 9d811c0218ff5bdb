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


class MemoryProbe:
    """What a strategy holds, from its tensors (`memory.json`): a mixin of `base.Strategy`, whose
    `module`, `optimizer`, `reference`, `env`, `device` and `_grad_bytes` it reads."""

    module: Any
    optimizer: Any
    reference: Any
    env: Any
    _grad_bytes: int | None

    def _param_tensors(self) -> list[Any]:
        assert self.module is not None
        return list(self.module.parameters())

    def _grad_tensors(self) -> list[Any]:
        """The gradient tensors this rank holds now: `.grad` of the module's and the optimizer's parameters."""
        assert self.module is not None
        out = [p.grad for p in self.module.parameters()]
        if self.optimizer is not None:
            out += [p.grad for g in self.optimizer.param_groups for p in g["params"]]
        return out

    def memory_devices(self) -> list[torch.device]:
        """The CUDA devices this rank computes on (several where a device_map splits the model)."""
        device = self.device  # type: ignore[attr-defined]
        cuda = self.env.cuda_available and torch.cuda.is_available() and device.type == "cuda"
        return [device] if cuda else []

    def _track_gradients(self) -> None:
        """Record the gradient bytes held when the optimizer first steps (engines free them right after)."""

        def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            if self._grad_bytes is None:
                self._grad_bytes = count_bytes(self._grad_tensors(), {})

        if self.optimizer is not None:
            self.optimizer.register_step_pre_hook(hook)

    def memory_breakdown(self) -> dict:
        """Bytes this rank holds, from its tensors (`memory.json`): `params` (its shards), `grads` (at
        the first optimizer step), `optimizer` (state and its own parameters, e.g. fp32 masters),
        `reference` (the frozen reference model's bytes here; 0 without one), `peak_device` (CUDA's
        peak allocated since `wrap`, summed over :meth:`memory_devices`; None on the CPU)."""
        from scaletune.strategies.frozen_reference import reference_tensors

        seen: dict = {}
        p_bytes = count_bytes(self._param_tensors(), seen)
        o_bytes = count_bytes(optimizer_tensors(self.optimizer), seen)
        grads = self._grad_bytes if self._grad_bytes is not None else count_bytes(self._grad_tensors(), dict(seen))
        return {
            "rank": self.env.rank,
            "params": int(p_bytes),
            "grads": int(grads),
            "optimizer": int(o_bytes),
            "reference": int(count_bytes(reference_tensors(self.reference), seen)),
            "peak_device": peak_device_bytes(self.memory_devices()),
        }
