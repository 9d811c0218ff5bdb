"""Model and data factories for the tests of `model.factory` / `data.factory`: a small regression
model that follows the contract (and runs on the meta device), and factories that break it."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class TinyRegressor(nn.Module):
    """forward(x [B, 4], y [B]) -> (summed squared error, B)."""

    def __init__(self, width: int = 8, blocks: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).squeeze(-1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
        return ((self.predict(x) - y) ** 2).sum(), y.numel()


class NoLoss(TinyRegressor):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # the contract broken: no loss
        return self.predict(x)


def build_tiny(width: int = 8, blocks: int = 2) -> nn.Module:
    return TinyRegressor(width, blocks)


def build_wrong_type() -> dict:
    return {"not": "a module"}


def build_no_loss() -> nn.Module:
    return NoLoss()


class Points(torch.utils.data.Dataset):
    """y = sum of x's coordinates, x ~ N(0, 1) (a fixed generator)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}


def collate(items: list[dict]) -> dict:
    # num_units: one target per row (the loop counts it before the step; forward is not given it).
    x, y = torch.stack([it["x"] for it in items]), torch.stack([it["y"] for it in items])
    return {"x": x, "y": y, "num_units": len(items)}


def build_data(tokenizer, n: int = 64) -> tuple:
    return Points(n), collate


def build_bad_data(tokenizer) -> int:
    return 42
