"""Every shipped example under examples/ resolves as `scaletune train` would resolve it on this
CPU machine: the schema, every cross-field rule (with `strategy: auto` decided by the planner),
each stage's data sources and, for `model.factory` / `data.factory` examples, the factory checks.
The model itself is not loaded: the examples name folders a user builds first (`init-model`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletune.config import read_config
from scaletune.data import validate_data
from scaletune.plan import choose_auto
from scaletune.plan.factory_check import factory_problems
from scaletune.resolve import resolve, wanted_world_size
from tests.helpers import REPO_ROOT, SMALL_TOKENIZER, digit_chats, make_env

EXAMPLES = sorted((REPO_ROOT / "examples").rglob("*.yaml"))


def test_there_are_examples_to_check():
    names = {p.relative_to(REPO_ROOT).as_posix() for p in EXAMPLES}
    assert {"examples/quickstart.yaml", "examples/quickstart-tiny.yaml", "examples/digits/digits.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(REPO_ROOT / "examples").as_posix())
def test_example_resolves_with_every_rule(path: Path, monkeypatch, tmp_path):
    # The examples' paths (data files, factory files) are relative to the repository root, where
    # their comments say to run them.
    monkeypatch.chdir(REPO_ROOT)
    if path.parent.name == "vlm-digits":  # its model and data are built first (its comment's first commands)
        from scaletune.models import init_model

        # Its stages name the model's parameter groups, which the factory check resolves on the model.
        init_model("idefics3-tiny", tmp_path / "runs" / "models" / "idefics3-tiny", tokenizer_file=SMALL_TOKENIZER)
        digit_chats(tmp_path / "data" / "vlm-digits", 4, 2)
        (tmp_path / "examples").symlink_to(REPO_ROOT / "examples")
        monkeypatch.chdir(tmp_path)
    loaded = read_config(path)
    assert loaded.problems == [], loaded.problems
    world = wanted_world_size(loaded.config, make_env())
    spec = resolve(loaded, make_env(world), choose_auto=choose_auto)  # raises ConfigError naming each problem
    assert spec.stages, f"{path}: no stage to train"
    for stage in spec.stages:
        validate_data(stage.data)  # raises UserError: a missing file, an unknown format
    assert factory_problems(spec) == []
