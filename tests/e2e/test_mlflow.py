"""MLflow as a metrics sink (`logging.mlflow`, trainer/tracking.py), against a real MLflow tracking
store (SQLite under the test's folder; no network): a run through the CLI read back with
`MlflowClient` against its metrics.jsonl; a resume from a mid-run checkpoint continuing the same
MLflow run, each step once; a planted secret absent from every file of the store; a missing mlflow
refused by the preflight (exit 2); a tracking server that is down costing one warning, not the run."""

from __future__ import annotations

import copy
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import make_config, metrics, subprocess_env, train

# scripts/test.sh installs MLflow's client beside the venv, not in it (why: there), and names the
# folder here; this module and its runs put it on their path.
CLIENT = os.environ.get("SCALETUNE_TEST_MLFLOW", "")
if CLIENT and CLIENT not in sys.path:
    sys.path.append(CLIENT)
if importlib.util.find_spec("mlflow") is None:
    if os.environ.get("CI") == "true":
        raise RuntimeError("CI runs the MLflow tests: no mlflow client (scripts/test.sh installs one)")
    pytest.skip(
        "needs mlflow: bash scripts/test.sh installs it (or pip install 'scaletune[mlflow]')", allow_module_level=True
    )


def client_env() -> dict[str, str]:
    """The runs' environment: the test environment with the MLflow client on PYTHONPATH."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, (subprocess_env()["PYTHONPATH"], CLIENT)))}


SECRET = "hf-token-in-config-env-61c2e0"
BASE = {
    "data": {"eval_fraction": 0.1},
    # constant lr: a resumed run redoes the steps after its checkpoint with the first attempt's values
    "training": {"max_steps": 4, "save_every": 2, "eval_every": 2, "lr_scheduler": "constant", "warmup_steps": 0},
    "distributed": {"strategy": "single", "num_processes": 1, "env": {"HF_TOKEN": SECRET}},
}


def _mlflow_section(store: Path) -> dict:
    return {
        "tracking_uri": f"sqlite:///{store}",
        "experiment": "scaletune-tests",
        "run_name": "tiny",
        "tags": {"team": "nlp"},
    }


@pytest.fixture(scope="module")
def first_run(tiny_model_dir, module_tmp_path):
    """4 steps (checkpoints at 2 and 4, eval at 2 and 4) logged to a SQLite store; MLflow's artifacts
    go under the working directory (`./mlruns`), the test's folder."""
    tmp = module_tmp_path
    cfg = make_config(tiny_model_dir, tmp / "run", BASE, logging={"mlflow": _mlflow_section(tmp / "mlflow.db")})
    proc = train(cfg, tmp, cwd=tmp, env=client_env())
    return tmp, cfg, proc


def _client(tmp: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_params_metrics_and_artifacts_read_back_match_the_run(first_run):
    tmp, cfg, proc = first_run
    run_dir, client = tmp / "run", _client(tmp)
    run_id = (run_dir / "mlflow-run-id").read_text().strip()
    assert f"[scaletune] MLflow run {run_id}" in proc.stderr
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny"
    assert client.get_experiment(run.info.experiment_id).name == "scaletune-tests"
    assert run.data.tags["team"] == "nlp"
    params = run.data.params
    assert params["training.learning_rate"] == "0.002" and params["training.max_steps"] == "4"
    assert params["model.name_or_path"] == cfg["model"]["name_or_path"]
    assert params["logging.mlflow.experiment"] == "scaletune-tests" and params["model.lora"] == "null"
    assert params["distributed.env.HF_TOKEN"] == "<redacted>"
    rows = metrics(run_dir)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    # Every number of every line at its step, the values exactly those of metrics.jsonl.
    for key, name in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm")):
        assert _history(client, run_id, name) == [(r["step"], pytest.approx(r[key], rel=1e-12)) for r in train_rows]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    assert [s for s, _ in evals] == [2, 4]
    assert _history(client, run_id, "eval/loss") == [(s, pytest.approx(v, rel=1e-12)) for s, v in evals]
    assert "train/step" not in run.data.metrics and "train/total_steps" not in run.data.metrics
    # The small files of the run directory, never a checkpoint (the run has two).
    assert (run_dir / "checkpoints" / "step-2").is_dir()
    assert sorted(a.path for a in client.list_artifacts(run_id)) == ["config.yaml", "loss.png", "metrics.jsonl"]
    got = Path(client.download_artifacts(run_id, "metrics.jsonl", str(tmp / "download")))
    assert got.read_text() == (run_dir / "metrics.jsonl").read_text()


def test_no_secret_reaches_the_tracking_store(first_run):
    tmp, _, _ = first_run
    store = [tmp / "mlflow.db", *(p for p in (tmp / "mlruns").rglob("*") if p.is_file())]
    assert len(store) > 3, store
    blob = b"".join(p.read_bytes() for p in store)
    # control: the scan reads what the store holds in plain text (the run's name, the redaction mark)
    assert b"scaletune-tests" in blob and b"<redacted>" in blob
    assert (tmp / "config.yaml").read_text().count(SECRET) == 1  # the secret was in the config
    assert SECRET.encode() not in blob


def test_a_resume_continues_the_same_mlflow_run_without_repeating_a_step(first_run):
    """Resumed from step 2 as after a crash (the MLflow run holds steps 1-4 already) and run on to
    step 6: steps 3 and 4 are redone but not logged again, 5 and 6 are appended."""
    tmp, cfg, _ = first_run
    run_dir, client = tmp / "run", _client(tmp)
    run_id = (run_dir / "mlflow-run-id").read_text().strip()
    before = _history(client, run_id, "train/loss")
    again = copy.deepcopy(cfg)
    again["training"].update(max_steps=6, resume=str(run_dir / "checkpoints" / "step-2"))
    proc = train(again, tmp, name="resume.yaml", cwd=tmp, env=client_env())
    assert "resumed from" in proc.stderr
    assert (run_dir / "mlflow-run-id").read_text().strip() == run_id
    assert len(client.search_runs([client.get_experiment_by_name("scaletune-tests").experiment_id])) == 1
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    train_rows = [r for r in metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
    history = _history(client, run_id, "train/loss")
    assert [s for s, _ in history] == [1, 2, 3, 4, 5, 6]  # once each
    assert history[:4] == before  # the first attempt's points stay as they were
    # ... and they are what the resumed run computed again for steps 3 and 4 (a deterministic resume)
    assert [v for _, v in history] == pytest.approx([r["loss"] for r in train_rows], rel=1e-4)
    evals = [(r["step"], r["eval_loss"]) for r in metrics(run_dir) if "eval_loss" in r]
    assert [s for s, _ in _history(client, run_id, "eval/loss")] == [s for s, _ in evals] == [2, 4, 6]
    got = Path(client.download_artifacts(run_id, "metrics.jsonl", str(tmp / "download-2")))
    assert got.read_text() == (run_dir / "metrics.jsonl").read_text()


def test_without_mlflow_the_preflight_exits_2_naming_the_extra(tiny_model_dir, tmp_path):
    """`import mlflow` fails in the child (`sys.modules["mlflow"] = None`, as for a package not
    installed); the real CLI's preflight refuses before anything is loaded or written."""
    out = tmp_path / "run"
    path = tmp_path / "c.yaml"
    cfg = make_config(tiny_model_dir, out, logging={"mlflow": _mlflow_section(tmp_path / "mlflow.db")})
    path.write_text(yaml.safe_dump(cfg))
    shim = "import runpy, sys; sys.modules['mlflow'] = None; runpy.run_module('scaletune', run_name='__main__')"
    proc = subprocess.run(
        [sys.executable, "-c", shim, "train", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
    assert "logging.mlflow needs the mlflow package, which is not installed" in proc.stderr
    assert "pip install 'scaletune[mlflow]'" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists() and not (tmp_path / "mlflow.db").exists()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_tracking_failure_warns_once_and_never_raises(tmp_path, monkeypatch, capsys):
    from scaletune.trainer.tracking import MlflowTracker

    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root: ./mlruns
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    down = {"tracking_uri": f"http://127.0.0.1:{_closed_port()}", "experiment": "x"}
    cfg = make_config("unused", tmp_path / "run", logging={"mlflow": down}, as_config=True)
    (tmp_path / "run").mkdir()
    tracker = MlflowTracker(cfg, tmp_path / "run")  # the server is down from the start
    tracker.log({"train/loss": 1.0}, 1)
    tracker.close("finished")
    err = capsys.readouterr().err
    assert err.count("[scaletune] warning: MLflow failed starting the run") == 1 and err.count("warning") == 1, err
    assert "training goes on without MLflow" in err
    # A store that works, then fails mid-run: one warning, later steps skipped without a call.
    up = {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    cfg = make_config("unused", tmp_path / "run", logging={"mlflow": up}, as_config=True)
    tracker = MlflowTracker(cfg, tmp_path / "run")
    run_id = tracker.run_id
    assert run_id is not None
    tracker.log({"train/loss": 2.0}, 1)
    calls = []

    def refused(*args, **kwargs):
        calls.append(args)
        raise ConnectionError("tracking server went away")

    monkeypatch.setattr(tracker.client, "log_batch", refused)
    capsys.readouterr()
    for step in (2, 3, 4):
        tracker.log({"train/loss": 2.0}, step)
    tracker.close("finished")
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "MLflow failed logging step 2 (ConnectionError: tracking" in err, err
    assert len(calls) == 1
    assert [m.step for m in _client(tmp_path).get_metric_history(run_id, "train/loss")] == [1]
