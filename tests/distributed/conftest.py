"""Runs shared by the distributed tests: each configuration trains once per session, and the
parity, resume, resharding and export tests read its metrics, checkpoints and final/."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import make_config, train

RunFn = Callable[..., tuple[Path, subprocess.CompletedProcess]]


@pytest.fixture(scope="package")
def run_once(tiny_model_dir, tmp_path_factory) -> Iterator[RunFn]:
    """`run_once(name, model={...}, distributed={...}, training={...})` -> (run_dir, process):
    trains the base config with those sections updated, once per name; the runs (about 2.5 GB of
    checkpoints) are removed when the tests of this package are done.

    A run of more than one process starts as `torchrun --nproc-per-node N -m scaletune train`
    unless `launcher="scaletune"` (the plain command, re-executed under torchrun): the engines'
    arithmetic is the ranks' whatever started them, and the re-executing parent (its preflight,
    about 6 CPU-s a run) is proven by the mesh layouts' runs, the resumes from these runs
    (`parity_cases.resume_run`), the edge matrix, the preference and custom-model runs."""
    cache: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}

    def run(name: str, launcher: str = "torchrun", **sections: dict) -> tuple[Path, subprocess.CompletedProcess]:
        if name not in cache:
            tmp = tmp_path_factory.mktemp(name)
            cfg = make_config(tiny_model_dir, tmp / "run", **sections)
            cache[name] = (tmp / "run", train(cfg, tmp, launcher=launcher))
        return cache[name]

    yield run
    for run_dir, _ in cache.values():
        shutil.rmtree(run_dir.parent, ignore_errors=True)
