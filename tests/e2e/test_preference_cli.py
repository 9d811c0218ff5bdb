"""`scaletune train` with a preference config that cannot run: one message naming every problem
(file keys), exit 2, nothing written (issue 24)."""

from __future__ import annotations

import json

import yaml

from tests.helpers import make_config, run_cli


def test_bad_preference_configs_name_every_problem(tmp_path, tiny_model_dir):
    records = [{"instruction": "x", "output": "y"}]
    data = tmp_path / "alpaca.json"
    data.write_text(json.dumps(records))
    cfg = make_config(
        tiny_model_dir,
        tmp_path / "run",
        data={"train": {"path": str(data), "format": "alpaca"}, "packing": True},
        training={"objective": "dpo", "preference": {"reference": "base"}},
    )
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = run_cli(["train", str(path)])
    assert proc.returncode == 2, proc.stderr[-2000:]
    for key in ("data.train.format", "data.packing", "training.preference.reference"):
        assert key in proc.stderr, (key, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
