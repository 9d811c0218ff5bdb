"""One process, one device (or a device_map spread over several GPUs of one process)."""

from __future__ import annotations

import torch
from torch import nn

from scaletune.strategies.base import Strategy, check_devices


class SingleStrategy(Strategy):
    """No wrapper: the model trains where models/ placed it.

    Batches go to the placement's device (`models.placement.resolve_device_map`), not to this
    process's default one: with `model.device_map: cuda:1` the model is on cuda:1 (transformers
    records no `hf_device_map` for a one-device map), so the batches and the device check must be
    too; with a splitting map (`auto`) the inputs go to the first device and each layer's hook moves
    activations on.
    """

    name = "single"

    def setup(self) -> None:
        super().setup()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # kernels, streams and memory counters of that GPU

    @property
    def device(self) -> torch.device:
        return torch.device(self.placement.device)

    def memory_devices(self) -> list[torch.device]:
        if not torch.cuda.is_available():
            return []
        split = getattr(self.module.causal_lm if self.module is not None else None, "hf_device_map", None)
        if split:
            # Values are GPU indices, "cuda:N", "cpu" or "disk" (accelerate's offload).
            names = {f"cuda:{d}" if isinstance(d, int) else str(d) for d in split.values()}
            return [torch.device(n) for n in sorted(names) if n.startswith("cuda")]
        return super().memory_devices()

    def wrap(self, module: nn.Module) -> None:
        if getattr(getattr(module, "causal_lm", None), "hf_device_map", None) is None:
            # A device_map spreads layers over devices on purpose; otherwise one device holds all.
            check_devices(module, self.device, strategy=self.name)
        self.module = self.model = module
        self.optimizer = self.build_optimizer(module)
        self._finish_wrap()
