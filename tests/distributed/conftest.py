"""Runs shared by the distributed tests: each configuration trains once per session, and the
parity, resume, resharding and export tests read its metrics, checkpoints and final/."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.distributed.parity_cases import SHARED_RUNS, STARTED_AS_USERS_DO
from tests.helpers import make_config, train, train_batch

RunFn = Callable[..., tuple[Path, subprocess.CompletedProcess]]


@pytest.fixture(scope="package")
def run_once(tiny_model_dir, tmp_path_factory) -> Iterator[RunFn]:
    """`run_once(name, launcher=..., model={...}, distributed={...}, training={...})` -> (run_dir,
    process): trains the base config with those sections updated, once per name; the runs (about
    2.5 GB of checkpoints) are removed when the tests of this package are done. `run_once(name)`
    without sections: the name's entry in parity_cases.SHARED_RUNS.

    launcher="batch" (the default): the name's sections must be its entry in
    parity_cases.SHARED_RUNS, and the first such name asked for trains every entry of the same world
    size not trained yet, one after another in the ranks of one torchrun (tests/helpers.py
    train_batch; the record's stderr is rank 0's output). Their subject is the engines' and layouts'
    arithmetic and files: what the user's command adds around the loop is proven by the runs started
    with launcher="scaletune" (the plain command, re-executed under torchrun: two mesh layouts) or
    "torchrun" (`torchrun --nproc-per-node N -m scaletune train`: the device_map case), by the
    mesh layouts' resumes from these runs (`parity_cases.resume_run`, the plain command), the edge matrix's user
    cases, the preference and custom-model runs."""
    cache: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}
    given: dict[str, dict] = {}

    def world(sections: dict) -> int:
        return sections.get("distributed", {}).get("num_processes", 1)

    def run(name: str, launcher: str = "batch", **sections: dict) -> tuple[Path, subprocess.CompletedProcess]:
        sections = sections or SHARED_RUNS[name]
        if name in cache:
            assert given[name] == sections, f"run_once({name!r}) asked for with other sections than before"
            return cache[name]
        given[name] = sections
        if launcher != "batch":
            tmp = tmp_path_factory.mktemp(name)
            cfg = make_config(tiny_model_dir, tmp / "run", **sections)
            cache[name] = (tmp / "run", train(cfg, tmp, launcher=launcher))
            return cache[name]
        assert SHARED_RUNS.get(name) == sections, f"run_once({name!r}): not its entry in parity_cases.SHARED_RUNS"
        assert name not in STARTED_AS_USERS_DO, f"run_once({name!r}) starts as users do: give its launcher"
        names = [
            n
            for n, s in SHARED_RUNS.items()
            if world(s) == world(sections) and n not in cache and n not in STARTED_AS_USERS_DO
        ]
        folder = tmp_path_factory.mktemp(f"batch-world-{world(sections)}")
        configs = {n: make_config(tiny_model_dir, folder / n, **SHARED_RUNS[n]) for n in names}
        for n, proc in train_batch(configs, folder / "configs").items():
            cache[n] = (folder / n, proc)
            given.setdefault(n, SHARED_RUNS[n])
        return cache[name]

    yield run
    for run_dir, _ in cache.values():
        shutil.rmtree(run_dir.parent, ignore_errors=True)
