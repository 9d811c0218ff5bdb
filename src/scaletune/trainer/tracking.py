"""MLflow tracking of a run from rank 0 (`logging.mlflow`): the resolved config as parameters, each
logged step's numbers, the end status and the small files of the run directory as artifacts; a
resumed run continues its MLflow run. A tracking failure warns once and never stops training."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any, Literal

from scaletune.config import Config, redacted
from scaletune.env import print0

#: The file in `output_dir` naming the MLflow run, so a resumed run continues it.
MLFLOW_ID = "mlflow-run-id"
#: What the run directory hands MLflow at the end (when present): small files only, never checkpoints.
ARTIFACTS = ("config.yaml", "metrics.jsonl", "loss.png")
Outcome = Literal["finished", "stopped", "failed"]
#: How a run ended -> MLflow's run status (a run stopped on request is resumable: KILLED, not FINISHED).
STATUS: dict[str, str] = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
PARAMS_PER_BATCH = 100  # MLflow's limit on params in one log_batch
METRICS_PER_BATCH = 1000
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param's value


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """Nested config data as MLflow params: dotted names (`training.learning_rate`, list items of
    mappings by index: `stages.0.name`) -> the value as text (lists of plain values and null as
    JSON: `[1, 2]`, `null`), cut to MLflow's 6000 characters."""
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            out |= flatten(value, f"{prefix}{key}.")
        return out
    if isinstance(data, list) and any(isinstance(v, (dict, list)) for v in data):
        for i, value in enumerate(data):
            out |= flatten(value, f"{prefix}{i}.")
        return out
    text = data if isinstance(data, str) else json.dumps(data)
    return {prefix.rstrip("."): text[:MAX_PARAM_CHARS]}


def _without_credentials(text: str) -> str:
    """`text` with any `user:password@` of a URL in it dropped (error messages name URLs)."""
    return re.sub(r"(://)[^/@\s]+@", r"\1", text)


class MlflowTracker:
    """One MLflow run for this scaletune run, driven through `MlflowClient` (no global active run).

    The first failure of any call (a server down, a refused request) prints one warning and turns
    the tracker off: the rest of the run is not slowed by retries, and metrics.jsonl keeps every step.

    Raises:
        RuntimeError: the mlflow package is not installed (train's preflight says so first).
    """

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise RuntimeError("logging.mlflow needs the mlflow package: pip install 'scaletune[mlflow]'") from None
        m = cfg.logging.mlflow
        assert m is not None
        self.run_dir = run_dir
        self.run_id: str | None = None
        self._logged: dict[str, int] = {}  # metric -> last step the MLflow run holds (a resumed run)
        try:
            self.client = MlflowClient(tracking_uri=m.tracking_uri)
            id_file = run_dir / MLFLOW_ID
            previous = id_file.read_text().strip() if id_file.is_file() and cfg.training.resume else None
            run = self._continue(previous) if previous else None
            if run is None:
                run = self._create(m.experiment, m.run_name, m.tags)
            self.run_id = run.info.run_id
            id_file.write_text(self.run_id + "\n")
            self._log_params(flatten(redacted(cfg)), set(run.data.params))
            where = _without_credentials(self.client.tracking_uri)
            print0(f"[scaletune] MLflow run {self.run_id} (experiment {run.info.experiment_id}) at {where}")
        except Exception as exc:  # noqa: BLE001 - any tracking failure: warn once, train on
            self._fail("starting the run", exc)

    def _continue(self, run_id: str):
        """The MLflow run a previous start of this run created, marked running again, with the last
        step of each of its metrics; None (a new run) when the tracking store does not hold it."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            print0(f"[scaletune] MLflow run {run_id} of this run directory is not in this tracking store: a new run")
            return None
        self.client.update_run(run_id, status="RUNNING")
        for key in run.data.metrics:
            self._logged[key] = max((p.step for p in self.client.get_metric_history(run_id, key)), default=-1)
        return run

    def _create(self, experiment: str | None, run_name: str | None, tags: dict[str, str]):
        """A new run in `experiment` (created when missing) with `tags` and MLflow's usual context
        tags (user, source, git commit)."""
        from mlflow.tracking.context.registry import resolve_tags

        return self.client.create_run(self._experiment_id(experiment), run_name=run_name, tags=resolve_tags(tags))

    def _experiment_id(self, name: str | None) -> str:
        from mlflow.exceptions import MlflowException

        name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"  # "0": MLflow's Default experiment
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException as exc:  # another run created it meanwhile
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise exc from None
            return found.experiment_id

    def _log_params(self, params: dict[str, str], present: set[str]) -> None:
        """`params` that the run does not hold yet (MLflow params cannot change: a resumed run keeps
        its first start's values and adds the new names)."""
        from mlflow.entities import Param

        new = [Param(k, v) for k, v in params.items() if k not in present]
        for i in range(0, len(new), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[i : i + PARAMS_PER_BATCH])

    def log(self, scalars: dict[str, float], step: int) -> None:
        """One metrics line's numbers at `step`; a step the MLflow run holds already (a resumed run
        redoing the steps after its checkpoint) is not logged twice."""
        if self.run_id is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in scalars.items() if step > self._logged.get(k, -1)]
        try:
            for i in range(0, len(metrics), METRICS_PER_BATCH):
                self.client.log_batch(self.run_id, metrics=metrics[i : i + METRICS_PER_BATCH])
        except Exception as exc:  # noqa: BLE001 - any tracking failure: warn once, train on
            self._fail(f"logging step {step}", exc)

    def close(self, outcome: Outcome) -> None:
        """The run directory's small files as artifacts, then the run's end status."""
        if self.run_id is None:
            return
        try:
            for name in ARTIFACTS:
                if (self.run_dir / name).is_file():
                    self.client.log_artifact(self.run_id, str(self.run_dir / name))
            self.client.set_terminated(self.run_id, STATUS[outcome])
        except Exception as exc:  # noqa: BLE001 - any tracking failure: warn once, train on
            self._fail("ending the run", exc)

    def _fail(self, what: str, exc: Exception) -> None:
        self.run_id = None
        reason = _without_credentials(f"{type(exc).__name__}: {exc}".splitlines()[0])[:500]
        print0(
            f"[scaletune] warning: MLflow failed {what} ({reason}); training goes on without MLflow "
            "(metrics.jsonl has every step)"
        )
