"""The config reference is generated from the schema: the committed docs/config.md must be what
`scaletune config reference` writes now, and every field must be documented."""

from __future__ import annotations

import typing

from pydantic import BaseModel

from scaletune.config import Config
from scaletune.config.docs import reference_markdown
from tests.helpers import REPO_ROOT


def test_committed_reference_is_current():
    committed = (REPO_ROOT / "docs" / "config.md").read_text()
    assert committed == reference_markdown(), (
        "docs/config.md is stale: run `scaletune config reference -o docs/config.md` and commit it"
    )


def _models(model: type[BaseModel], seen: set) -> None:
    seen.add(model)
    for info in model.model_fields.values():
        for arg in (info.annotation, *typing.get_args(info.annotation)):
            for t in (arg, *typing.get_args(arg)):
                if isinstance(t, type) and issubclass(t, BaseModel) and t not in seen:
                    _models(t, seen)


def test_every_field_has_a_description():
    seen: set = set()
    _models(Config, seen)
    missing = [f"{m.__name__}.{name}" for m in seen for name, info in m.model_fields.items() if not info.description]
    assert not missing, f"fields without a docstring: {missing}"
    assert "Sequences per optimizer step, all ranks together" in reference_markdown()


def test_config_show_prints_every_default_and_the_decisions(tmp_path):
    import yaml
    from typer.testing import CliRunner

    from scaletune.cli import app

    path = tmp_path / "c.yaml"
    path.write_text("model: {name_or_path: llama-3.2-1b, dtype: auto}\ndata: {dummy: {}}\n")
    res = CliRunner().invoke(app, ["config", "show", str(path), "training.micro_batch_size=2"])
    assert res.exit_code == 0, res.output
    assert "# strategy: single (one process)" in res.stdout
    assert "# precision: compute float32" in res.stdout  # dtype auto on this CPU
    assert "gradient_accumulation_steps 16" in res.stdout  # 32 / (2 x 1)
    shown = yaml.safe_load(res.stdout)
    assert shown["training"]["micro_batch_size"] == 2 and shown["training"]["warmup_steps"] == 10
    assert shown["distributed"]["strategy"] == "single" and shown["model"]["trust_remote_code"] is False
