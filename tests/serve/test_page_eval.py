"""`scaletune eval RUN --tasks` results on the job page: a real run, evaluated by the real command
(lm-evaluation-harness on the shipped task, offline), shown in Chromium from the run's eval/ folder
with the numbers the harness wrote (the control: its JSON file)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import make_config, run_cli, train, wait_for
from tests.serve.serve_helpers import client, dom, plant_job


def test_eval_results_are_on_the_job_page(server, page, tiny_model_dir, tmp_path):  # noqa: F811
    pytest.importorskip("lm_eval")
    run = tmp_path / "run"
    train(make_config(tiny_model_dir, run, training={"max_steps": 1, "save_every": 0}), tmp_path)
    proc = run_cli(["eval", str(run), "--tasks", "alpaca_mc", "--limit", "4", "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads((run / "eval" / json.loads(proc.stdout)["file"].rsplit("/", 1)[1]).read_text())
    job_id = plant_job(server.svc, run)
    with client(server, server.read) as c:
        listing = c.get(f"/api/jobs/{job_id}/artifacts/eval").json()
    assert any(p.startswith("eval/lm_eval-") and p.endswith(".json") for p in listing), listing
    page.get(f"{server.url}/jobs/{job_id}")
    rows = wait_for(lambda: dom(page, "#evaluation tbody tr"), 30, "the evaluation table")
    shown = {tuple(r.split("\t")[1:4]) for r in rows}
    want = written["results"]["alpaca_mc"]
    for metric in ("acc", "acc_norm"):
        assert ("alpaca_mc", metric, f"{want[f'{metric},none']:.4f}") in shown, (metric, rows)
