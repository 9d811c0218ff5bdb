"""Fixtures of the security tier: real runs whose checkpoints the tests tamper with (the payloads
that would leave a trace if anything executed them are in tests/security/payloads.py)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import make_config, train


@pytest.fixture(scope="package")
def finished_runs(tiny_model_dir, tmp_path_factory) -> Iterator[dict[str, Path]]:
    """Two finished runs with two checkpoints each: DCP format (single) and DeepSpeed format
    (ZeRO-2 at world size 1). Tests copy them before tampering."""
    out = {}
    for name, dist in (("dcp", {"strategy": "single"}), ("deepspeed", {"strategy": "deepspeed", "zero_stage": 2})):
        tmp = tmp_path_factory.mktemp(f"finished-{name}")
        cfg = make_config(tiny_model_dir, tmp / "run", training={"max_steps": 2, "save_every": 1}, distributed=dist)
        train(cfg, tmp)
        out[name] = tmp / "run"
    yield out
    for run_dir in out.values():
        shutil.rmtree(run_dir.parent, ignore_errors=True)


@pytest.fixture
def run_copy(finished_runs, tmp_path):
    """`run_copy(kind)`: a private copy of a finished run to tamper with."""

    def copy(kind: str) -> Path:
        dst = tmp_path / f"run-{kind}"
        shutil.copytree(finished_runs[kind], dst)
        # The saved config names the original run as output_dir: point it at the copy, so a test
        # that trains from it never writes into the shared finished run.
        saved = dst / "config.yaml"
        saved.write_text(saved.read_text().replace(str(finished_runs[kind]), str(dst)))
        return dst

    return copy
