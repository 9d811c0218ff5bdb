"""The device side of a run: where a module's tensors are (checked before an engine wraps it) and
the GPU's fp32 matmul math (TF32)."""

from __future__ import annotations

import torch
from torch import nn


def check_devices(module: nn.Module, expected: torch.device | str, *, strategy: str, limit: int = 5) -> None:
    """Every parameter and buffer of `module` must be on `expected` before the engine wraps it.

    Catches the engines' "module must have its parameters and buffers on device cuda:0 ... found
    one of them on device: cpu" before they raise it, naming the first offending tensors.

    Raises:
        RuntimeError: naming up to `limit` tensors and their devices, and the fix.
    """
    want = torch.device(expected)
    bad = []
    for kind, items in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in items:
            d = t.device
            if d.type != want.type or (want.index is not None and d.index not in (None, want.index)):
                bad.append(f"{kind} {name} on {d}")
    if bad:
        more = f" and {len(bad) - limit} more" if len(bad) > limit else ""
        raise RuntimeError(
            f"strategy {strategy} expects every parameter and buffer on {want}, found "
            f"{'; '.join(bad[:limit])}{more}. This usually comes from device_map splitting the model "
            "or a module created after loading: load without device_map under a launcher, or move the "
            "module to the rank's device before training."
        )


def allow_tf32() -> None:
    """Let fp32 matmuls and convolutions on CUDA use TF32 tensor cores.

    Through the legacy setters, which keep every getter readable: torch 2.9+'s
    `torch.backends.cuda.matmul.fp32_precision = "tf32"` alone makes later reads of
    `torch.backends.cuda.matmul.allow_tf32` and `torch.get_float32_matmul_precision()` raise
    RuntimeError, and Inductor reads them on some paths (pytorch#166387), so `model.compile` would
    crash. `set_float32_matmul_precision("high")` sets the legacy flag and the new one together.
    """
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
