"""The Modal dispatcher against the real Modal SDK, up to the network (no Modal account is reachable
here): the image of the app a service job deploys installs scaletune's requirements (control: the
image of `scaletune modal`'s app for the same config, and scaletune's installed metadata); the job's
report URL and token reach the function as a `modal.Secret.from_dict` made at submit, in no file;
a Modal job needs `--public-url`; a job is settled by its call's result, not by a local `final/`.

The SDK objects are inspected through their own attributes (the image's layers render their
Dockerfile commands with the SDK's own builder functions; the Secret keeps its dict to send)."""

from __future__ import annotations

import importlib.util
import shlex
import time
import warnings
from importlib.metadata import requires
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from fastapi.testclient import TestClient

from scaletune.errors import UserError
from scaletune.report import TOKEN_ENV, URL_ENV
from scaletune.serve.app import create_app
from scaletune.serve.jobs import states as S
from scaletune.serve.jobs.db import Job
from scaletune.serve.jobs.dispatch.base import Status
from scaletune.serve.jobs.records import set_state
from scaletune.serve.jobs.service import JobService
from tests.helpers import make_config
from tests.serve.serve_helpers import TEST_POLICY, plant_job

modal = pytest.importorskip("modal")
from modal._image import LATEST_IMAGE_BUILDER_VERSION  # noqa: E402
from modal._utils.async_utils import synchronizer  # noqa: E402

from scaletune.serve.jobs.dispatch import modal as modal_dispatch  # noqa: E402

PUBLIC = "https://jobs.example.com/st"


@pytest.fixture
def no_modal_credentials(tmp_path, monkeypatch):
    for k in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "no-modal.toml"))


@pytest.fixture
def svc(tmp_path, no_modal_credentials):
    s = JobService(
        f"sqlite:///{tmp_path / 'db.sqlite'}",
        tmp_path / "jobs",
        "http://127.0.0.1:9",
        policy=TEST_POLICY,
        public_url=PUBLIC,
    )
    yield s
    s.engine.dispose()


def config_text(model: Path, run: Path, strategy: str = "ddp") -> str:
    return yaml.safe_dump(make_config(model, run, distributed={"strategy": strategy}))


def import_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec.loader.exec_module(module)
    return module


def pip_packages(image) -> list[str]:
    """The packages the image's `pip install` layers install, from the Dockerfile commands the SDK
    renders for each layer (its `dockerfile_function`, the one `_load` sends to Modal)."""
    out: list[str] = []
    todo = [synchronizer._translate_in(image)]
    while todo:
        layer = todo.pop()
        load = layer._load
        cells = dict(zip(load.__code__.co_freevars, [c.cell_contents for c in load.__closure__ or ()], strict=True))
        if cells.get("dockerfile_function"):
            for cmd in cells["dockerfile_function"](LATEST_IMAGE_BUILDER_VERSION).commands:
                if cmd.startswith("RUN python -m pip install "):
                    out += shlex.split(cmd)[5:]
        todo += list((cells.get("base_images") or {}).values())
        if cells.get("base_image") is not None:
            todo.append(cells["base_image"])
    return sorted(out)


def modal_job(svc: JobService, cfg: str, resources: dict | None = None):
    """A Modal job as the watcher hands it to the dispatcher (config written, token issued)."""
    job, _ = svc.prepare_job(cfg, [], "modal", resources or {"gpu_count": 1, "gpu_type": "H100"})
    token = svc.new_token(job)
    return job, token, svc.files(job)


def test_image_installs_scaletune_requirements(svc, tiny_model_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from scaletune.cli import app

    cfg = config_text(tiny_model_dir, tmp_path / "run")
    _, _, files = modal_job(svc, cfg)
    served = pip_packages(modal_dispatch.load_app(files).image)
    # Control 1: the app `scaletune modal` writes for the same config.
    (tmp_path / "c.yaml").write_text(cfg)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["modal", "c.yaml", "--gpu-count", "1", "-o", str(tmp_path / "cli_app.py")])
    assert res.exit_code == 0, res.output
    cli = pip_packages(import_file(tmp_path / "cli_app.py", "scaletune_cli_app").image)
    # Control 2: scaletune's installed dependencies (no extras: the strategy is ddp, not deepspeed).
    metadata = sorted(r.split(";")[0].strip() for r in requires("scaletune") if "extra" not in r.partition(";")[2])
    assert len(metadata) >= 10 and "torch>=2.6" in metadata
    assert served == cli == metadata, (served, cli, metadata)


def test_report_url_and_token_reach_the_function_as_a_secret(svc, tiny_model_dir, tmp_path):
    cfg = config_text(tiny_model_dir, tmp_path / "run")
    job, token, files = modal_job(svc, cfg, {"gpu_count": 1, "secrets": ["huggingface"]})
    url = f"{PUBLIC}/api/jobs/{job.id}/report"
    module = modal_dispatch.load_app(files)
    fn = synchronizer._translate_in(modal_dispatch.train_function(files))
    secrets = list(fn._options.secrets)
    assert [s._rep for s in secrets[:-1]] == [repr(modal.Secret.from_name("huggingface"))]
    assert secrets[-1]._load_env_dict() == {URL_ENV: url, TOKEN_ENV: token}
    assert fn._rep == f"modal.Function.from_name('scaletune-{job.id}', 'train').with_options(...)", fn._rep
    assert module.app.name == f"scaletune-{job.id}"
    # The whole submit, up to Modal's refusal (no credentials): nothing it wrote holds them.
    with pytest.raises(Exception, match="Modal refused the job"):
        modal_dispatch.ModalDispatcher().submit(files)
    written = {p.name: p.read_text() for p in Path(job.job_dir).iterdir()}
    assert "modal_app.py" in written and "import modal" in written["modal_app.py"]
    for name, text in written.items():
        assert token not in text and url not in text and "jobs.example.com" not in text, name


def test_modal_job_needs_a_public_url(tmp_path, tiny_model_dir, no_modal_credentials):
    s = JobService(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs", "http://127.0.0.1:9", policy=TEST_POLICY)
    cfg = config_text(tiny_model_dir, tmp_path / "run")
    with TestClient(create_app(s, start=False), base_url="http://127.0.0.1") as c:
        for dry in (True, False):
            r = c.post("/api/jobs", json={"config": cfg, "target": "modal", "dry_run": dry})
            assert r.status_code == 422 and "--public-url" in r.text and "127.0.0.1:9" in r.text, r.text
        assert c.post("/api/jobs", json={"config": cfg, "target": "local", "dry_run": True}).status_code == 200
    s.engine.dispose()


class Call:
    """What `FunctionCall.get(timeout=0)` does for a call in each state (Modal is not reachable):
    returns the function's result or raises what the SDK raises."""

    def __init__(self, result=None, raises: BaseException | None = None) -> None:
        self.result, self.raises = result, raises

    def get(self, timeout=None):
        assert timeout == 0
        if self.raises is not None:
            raise self.raises
        return self.result


@pytest.mark.parametrize(
    "call, status",
    [
        (Call(raises=TimeoutError()), Status("running")),
        (Call({"exit_code": 0, "final": True}), Status("exited", 0, final=True)),
        (Call({"exit_code": 3, "final": False}), Status("exited", 3, final=False)),
        (Call(raises=modal.exception.FunctionTimeoutError("24 h")), Status("exited", 1)),
        (Call(raises=modal.exception.OutputExpiredError()), Status("exited", None)),
        (Call(raises=modal.exception.AuthError("token missing")), Status("ending")),
        (Call(raises=RuntimeError("raised in the function")), Status("exited", 1)),
    ],
)
def test_outcome_of_a_call(call, status):
    assert modal_dispatch.outcome(call) == status


class ResultDispatcher(modal_dispatch.ModalDispatcher):
    """The Modal dispatcher with its call's answer given (Modal is not reachable): submit returns a
    call id, poll maps the given result as the real poll maps `FunctionCall.get(timeout=0)`."""

    def __init__(self, result) -> None:
        self.result = result

    def submit(self, job):
        return "fc-test"

    def poll(self, target_id, job):
        return modal_dispatch.outcome(Call(self.result))


@pytest.mark.parametrize(
    "result, state", [({"exit_code": 0, "final": True}, S.SUCCEEDED), ({"exit_code": 1, "final": False}, S.FAILED)]
)
def test_settled_by_the_calls_result_not_a_local_final(svc, tiny_model_dir, tmp_path, result, state):
    svc.dispatchers["modal"] = svc.watcher.dispatchers["modal"] = ResultDispatcher(result)
    r = svc.submit(config_text(tiny_model_dir, tmp_path / "run"), [], "modal", {"gpu_count": 1})
    deadline = time.monotonic() + 20
    while True:  # the submit and the poll run in the watcher's workers; each tick asks again
        svc.kick()
        with svc.Session() as s:
            job = s.get(Job, r["id"])
        if job.state in S.TERMINAL or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not (Path(job.run_dir) / "final").exists()  # the run directory is on the volume
    assert (job.state, job.exit_code) == (state, result["exit_code"]), (job.state, job.reason, job.message)


def test_logs_and_run_directory_come_from_modal(svc, tiny_model_dir, tmp_path):
    _, _, files = modal_job(svc, config_text(tiny_model_dir, tmp_path / "run"), {"gpu_count": 1, "volume": "v1"})
    d = modal_dispatch.ModalDispatcher()
    (files.job_dir / "train.log").write_text("a local file is not the call's log\n")
    assert d.logs(files) == ""  # no call yet
    (files.job_dir / modal_dispatch.CALL_FILE).write_text("fc-abc\n")
    assert d.logs(files) == ""  # the SDK's tail is asked, and refused here (no credentials)
    assert modal_dispatch.volume_path(files, str(tmp_path / "run")) == {
        "volume": "v1",
        "path": "run",
        "fetch": "modal volume get v1 run",
    }


def test_a_lost_modal_job_is_settled_by_its_calls_result(svc, tmp_path):
    """A job settled `lost` (e.g. by a restart that could not reach Modal) is asked again in a
    worker; the call's result settles it."""
    svc.dispatchers["modal"] = svc.watcher.dispatchers["modal"] = ResultDispatcher({"exit_code": 0, "final": True})
    job_id = plant_job(svc, tmp_path / "run", state=S.FAILED, reason=S.LOST, target_id="fc-test")
    with svc.Session() as s:
        s.get(Job, job_id).target = "modal"
        s.commit()
    deadline = time.monotonic() + 20
    while (job := svc.get(job_id)).state != S.SUCCEEDED and time.monotonic() < deadline:
        svc.watcher._rechecked.clear()  # not every tick asks a lost job's target; this one may
        svc.kick()
        time.sleep(0.1)
    assert (job.state, job.exit_code, job.reason) == (S.SUCCEEDED, 0, None), (job.state, job.reason, job.message)


class Killed(BaseException):
    """The service's process ending in the middle of a call (nothing after it runs)."""


def stand_in_modal(monkeypatch, files, deploy=None, spawn=None):
    """STANDS IN FOR MODAL'S SERVER (not reachable here) in `submit`: the app's deploy and the
    function's spawn, each running `deploy` / `spawn` (a check, or Killed); the spawn's call id
    `fc-1`. The rest of `submit` (its files, their order) is the real code."""
    seen = {}

    def spawned():
        seen["at spawn"] = sorted(p.name for p in files.job_dir.glob("modal-*"))
        if spawn:
            spawn()
        return SimpleNamespace(object_id="fc-1")

    app = SimpleNamespace(deploy=deploy or (lambda: None))
    monkeypatch.setattr(modal_dispatch, "load_app", lambda job: SimpleNamespace(app=app))
    monkeypatch.setattr(modal_dispatch, "train_function", lambda job: SimpleNamespace(spawn=spawned))
    return seen


def test_a_restart_during_submit_adopts_requeues_or_fails(svc, tiny_model_dir, tmp_path, monkeypatch):
    """What `adopt` finds after the service stopped at each point of `submit`: after the spawn, the
    call (adopted); during the deploy, nothing (started again: a second deploy is harmless); during
    the spawn, a call that may run (the job fails: never spawned twice); a resumed job's last-run
    files are not taken for this start's."""
    _, _, files = modal_job(svc, config_text(tiny_model_dir, tmp_path / "run"))
    d = modal_dispatch.ModalDispatcher()
    call_file, spawn_file = files.job_dir / modal_dispatch.CALL_FILE, files.job_dir / modal_dispatch.SPAWN_FILE
    assert d.adopt(files) is None  # control: nothing written, nothing started
    call_file.write_text("fc-old\n")  # a previous run's call (resumed job)
    seen = stand_in_modal(monkeypatch, files)
    assert d.submit(files) == "fc-1" and d.adopt(files) == "fc-1"
    assert seen["at spawn"] == [modal_dispatch.SPAWN_FILE]  # marked before the spawn, the old call gone

    time.sleep(0.05)  # past the file system's clock tick
    files.config_path.write_text(files.config_path.read_text())  # what a resume does
    assert d.adopt(files) is None  # the last run's marker and call are not this start's

    def killed():
        raise Killed

    stand_in_modal(monkeypatch, files, deploy=killed)
    with pytest.raises(Killed):
        d.submit(files)
    assert d.adopt(files) is None and not call_file.exists()  # stopped before the spawn: start it again

    stand_in_modal(monkeypatch, files, spawn=killed)
    with pytest.raises(Killed):
        d.submit(files)
    with pytest.raises(UserError, match=f"app scaletune-{files.job_id}.*not started again"):
        d.adopt(files)
    assert spawn_file.exists() and not call_file.exists()


class CountingModal(modal_dispatch.ModalDispatcher):
    """The real `adopt`; submit and poll STAND IN FOR MODAL (not reachable here), submit counted."""

    def __init__(self) -> None:
        self.submits: list[str] = []

    def submit(self, job):
        self.submits.append(job.job_id)
        return "fc-new"

    def poll(self, target_id, job):
        return Status("running")

    def logs(self, job, offset=None, limit=1 << 20):
        return ""


def test_a_restarted_service_never_spawns_a_modal_job_twice(svc, tiny_model_dir, tmp_path):
    """Three jobs left `starting` by a service that stopped during their submit, as the next service
    starts: cut off during the spawn (fails, `lost`, with what to check; no second submit), after
    it (the call adopted), before it (control: queued and submitted again, once)."""
    d = svc.dispatchers["modal"] = svc.watcher.dispatchers["modal"] = CountingModal()
    ids = {}
    for case in ("during spawn", "after spawn", "before spawn"):
        job, _, files = modal_job(svc, config_text(tiny_model_dir, tmp_path / case.replace(" ", "-")))
        with svc.lock, svc.Session() as s:
            s.add(job)
            s.flush()
            set_state(s, job, S.STARTING)
            s.commit()
        ids[case] = job.id
        if case != "before spawn":
            modal_dispatch._write(files.job_dir / modal_dispatch.SPAWN_FILE, modal_dispatch._attempt(files))
        if case == "after spawn":
            modal_dispatch._write(files.job_dir / modal_dispatch.CALL_FILE, "fc-9")
    svc.watcher.reattach_all()
    deadline = time.monotonic() + 20
    while svc.get(ids["before spawn"]).target_id is None and time.monotonic() < deadline:
        svc.kick()
        time.sleep(0.1)
    for _ in range(5):  # more ticks: nothing else is started
        svc.kick()
        time.sleep(0.05)
    cut, adopted, again = (svc.get(ids[k]) for k in ("during spawn", "after spawn", "before spawn"))
    assert (cut.state, cut.reason, cut.target_id) == (S.FAILED, S.LOST, None), (cut.state, cut.message)
    assert "whether its call started is unknown" in cut.message and f"scaletune-{cut.id}" in cut.message
    assert (adopted.state, adopted.target_id) == (S.STARTING, "fc-9")
    assert again.target_id == "fc-new" and d.submits == [ids["before spawn"]], d.submits
