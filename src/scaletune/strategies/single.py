"""One process, one device (or a device_map spread over several GPUs of one process)."""

from __future__ import annotations

from torch import nn

from scaletune.strategies.base import Strategy, check_devices


class SingleStrategy(Strategy):
    """No wrapper: the model trains where models/ placed it."""

    name = "single"

    def wrap(self, module: nn.Module) -> None:
        if getattr(getattr(module, "causal_lm", None), "hf_device_map", None) is None:
            # A device_map spreads layers over devices on purpose; otherwise one device holds all.
            check_devices(module, self.device, strategy=self.name)
        self.module = self.model = module
        self.optimizer = self.build_optimizer(module)
        self._track_gradients()
