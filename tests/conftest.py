"""Shared test fixtures: the real data in ../shared/data, tiny models, the slow tier. Constants and
builders are in tests/helpers.py (import them from there, never from this file)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import ALPACA_5000, SHARED_DATA

# Tests never reach a hub; DeepSpeed runs on its CPU accelerator where no CUDA GPU is visible (the
# GPU tier needs it on CUDA).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `slow` repeat a proof another test makes more cheaply (another engine of the
    same parity, another reshard direction) or measure rather than prove: they run with
    SCALETUNE_SLOW_TESTS=1 (`bash scripts/test.sh --slow`), not in the default run CI makes."""
    if os.environ.get("SCALETUNE_SLOW_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="slow tier: set SCALETUNE_SLOW_TESTS=1 (bash scripts/test.sh --slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not ALPACA_5000.is_file():
        pytest.fail(f"the reference data is missing: {ALPACA_5000} (../shared/data beside the clone)")
    return SHARED_DATA


@pytest.fixture(scope="module")
def module_tmp_path(request, tmp_path_factory) -> Iterator[Path]:
    """A folder for the runs one module's tests share, removed when the module is done.

    The suite trains a few hundred runs whose checkpoints (about 150 MB each) would fill the disk
    if each stayed until the session ends; `tmp_path` is removed after each passing test
    (`tmp_path_retention_policy = "failed"` in pyproject.toml) and this one after its module."""
    path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The `olmo2-tiny` preset, randomly initialised and saved once per test session."""
    from scaletune.models import init_model

    return init_model("olmo2-tiny", tmp_path_factory.mktemp("models") / "olmo2-tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from scaletune.models import init_model

    return init_model("llama-tiny", tmp_path_factory.mktemp("models") / "llama-tiny", seed=0)
