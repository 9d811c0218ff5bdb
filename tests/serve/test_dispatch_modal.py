"""The Modal dispatcher against the real Modal SDK, up to the network (no Modal account is reachable
here): the image of the app a service job deploys installs scaletune's requirements (control: the
image of `scaletune modal`'s app for the same config, and scaletune's installed metadata); the job's
report URL and token reach the function as a `modal.Secret.from_dict` made at submit, in no file;
a Modal job needs `--public-url`; a job is settled by its call's result, not by a local `final/`.

The SDK objects are inspected through their own attributes (the image's layers render their
Dockerfile commands with the SDK's own builder functions; the Secret keeps its dict to send)."""

from __future__ import annotations

import importlib.util
import json
import shlex
import time
import warnings
from importlib.metadata import requires
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from fastapi.testclient import TestClient
from sqlalchemy import select

from scaletune.errors import UserError
from scaletune.report import TOKEN_ENV, URL_ENV
from scaletune.serve.app import create_app
from scaletune.serve.jobs import states as S
from scaletune.serve.jobs.db import Event, Job
from scaletune.serve.jobs.dispatch.base import NotAccepted, Status, SubmitUnknown
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
    function = SimpleNamespace(spawn=spawned, hydrate=lambda: None, object_id="fu-1-v1")
    monkeypatch.setattr(modal_dispatch, "load_app", lambda job: SimpleNamespace(app=app))
    monkeypatch.setattr(modal_dispatch, "train_function", lambda job: function)
    return seen


def test_a_restart_during_submit_adopts_requeues_or_fails(svc, tiny_model_dir, tmp_path, monkeypatch):
    """What `adopt` finds after the service stopped at each point of `submit`: after the spawn, the
    call (adopted); during the deploy, nothing (started again: a second deploy is harmless); during
    the spawn, a call that may run: Modal is asked (`reconcile`, here refused: no credentials, so
    still unknown), and once asked in vain for `reconcile_for_s` the job fails, never spawned twice;
    a marker of an older service (no variant to ask by) fails it at once; a resumed job's last-run
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
    with pytest.raises(SubmitUnknown, match=f"app scaletune-{files.job_id}.*not spawned a second time"):
        d.adopt(files)
    assert spawn_file.exists() and not call_file.exists()
    with pytest.raises(SubmitUnknown, match="cannot be asked now"):  # the real SDK: no credentials
        d.reconcile(files)
    d.reconcile_for_s = 0  # asked for long enough
    with pytest.raises(UserError, match=f"app scaletune-{files.job_id}.*not started again") as gave_up:
        d.reconcile(files)
    assert not isinstance(gave_up.value, NotAccepted) and "modal function calls fu-1-v1" in str(gave_up.value)
    spawn_file.write_text(modal_dispatch._attempt(files) + "\n")  # an older service's marker: no variant
    with pytest.raises(SubmitUnknown):
        d.adopt(files)
    with pytest.raises(UserError, match="is unknown.*not started again"):
        d.reconcile(files)


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
    starts: cut off during the spawn (`submit unknown`: Modal is asked, here in vain, no
    credentials; no second submit), after it (the call adopted), before it (control: queued and
    submitted again, once)."""
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
            mark = {"attempt": modal_dispatch._attempt(files), "function": "fu-1-v1", "since": time.time()}
            modal_dispatch._write(files.job_dir / modal_dispatch.SPAWN_FILE, json.dumps(mark))
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
    assert (cut.state, cut.reason, cut.target_id) == (S.STARTING, S.SUBMIT_UNKNOWN, None), (cut.state, cut.message)
    assert f"scaletune-{cut.id}" in cut.message or "cannot be asked now" in cut.message, cut.message
    assert (adopted.state, adopted.target_id) == (S.STARTING, "fc-9")
    assert again.target_id == "fc-new" and d.submits == [ids["before spawn"]], d.submits


# -- a spawn that raises after Modal took the call (issue 39, item 15) ---------------------------
@pytest.fixture
def loopback_modal(svc, monkeypatch, tmp_path):
    """Modal's API on loopback (tests/serve/loopback_modal.py), the real SDK pointed at it (its
    client made afresh: the SDK keeps one per process)."""
    from modal.client import _Client

    from tests.serve.loopback_modal import LoopbackModal

    server = LoopbackModal()
    monkeypatch.setenv("MODAL_SERVER_URL", server.url)
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-loopback")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-loopback")
    _Client._set_env_client(None)
    # STANDS IN FOR the app's deploy: dozens of requests (image, mounts, app) this server does not
    # serve; the deploy is not what is tested. The Function, its Secret and the spawn are the SDK's.
    app = SimpleNamespace(deploy=lambda: None)
    monkeypatch.setattr(modal_dispatch, "load_app", lambda job: SimpleNamespace(app=app))
    yield server
    _Client._set_env_client(None)
    server.close()


def until(svc: JobService, job_id: str, done, timeout: float = 20) -> Job:
    """The job once `done(job)`, the watcher ticked meanwhile (its Modal calls run in workers)."""
    deadline = time.monotonic() + timeout
    while not done(job := svc.get(job_id)) and time.monotonic() < deadline:
        svc.kick()
        time.sleep(0.1)
    return job


def test_a_spawn_that_raises_after_modal_took_the_call_runs_as_that_call(svc, loopback_modal, tiny_model_dir, tmp_path):
    """The spawn's answer is lost after Modal made the call: the SDK tries again (each try Modal
    takes is one more call) and then raises. The job is not `submit failed` (as it was recorded
    before): it runs as the first call Modal took, and the calls the retries made are cancelled, so
    one runs. Control, through the same code: a spawn Modal refuses before making any call fails
    `submit failed`, naming the lookup (and not the job's token, which the refusal repeated)."""
    svc.dispatchers["modal"].settle_s = 0  # the listing here is exact at once (Modal's: `settle_s`)
    loopback_modal.lose_map_answers = True
    r = svc.submit(config_text(tiny_model_dir, tmp_path / "taken"), [], "modal", {"gpu_count": 1})
    job = until(svc, r["id"], lambda j: j.state in (S.RUNNING, *S.TERMINAL))
    made = [c.id for c in loopback_modal.calls]
    assert len(made) >= 2, (
        loopback_modal.seen,
        job.state,
        job.message,
    )  # the SDK retried the spawn: Modal holds several calls
    assert (job.state, job.reason, job.target_id) == (S.RUNNING, None, made[0]), (job.state, job.message)
    assert loopback_modal.live_calls() == [made[0]]  # the retries' calls cancelled: one runs
    assert (Path(job.job_dir) / modal_dispatch.CALL_FILE).read_text().strip() == made[0]
    with svc.Session() as s:
        events = list(s.scalars(select(Event).where(Event.job_id == job.id).order_by(Event.id)))
    assert S.FAILED not in [e.data.get("state") for e in events if e.kind == "state"]  # never failed on the way

    loopback_modal.lose_map_answers, loopback_modal.refuse_map = False, True
    r = svc.submit(config_text(tiny_model_dir, tmp_path / "refused"), [], "modal", {"gpu_count": 1})
    refused = until(svc, r["id"], lambda j: j.state in S.TERMINAL)
    assert (refused.state, refused.reason) == (S.FAILED, S.SUBMIT), (refused.state, refused.message)
    assert "lists no call of this submission" in refused.message and "refused, nothing made: ***" in refused.message
    (token,) = [v for v in loopback_modal.secrets[-1] if v.startswith("stj_")]  # the refused job's
    assert token not in refused.message  # repeated by Modal, hidden here
    assert len(loopback_modal.calls) == len(made)  # control: Modal made no call for it


def test_a_submit_whose_outcome_cannot_be_asked_waits_then_is_settled(svc, loopback_modal, tiny_model_dir, tmp_path):
    """The spawn's answer lost and Modal's listing not answering either: the job waits `starting`
    with reason `submit unknown` (not failed, not spawned again) while Modal holds its call; once
    Modal answers, the call is adopted. A job cancelled while unknown has its call cancelled when
    it is found (it must not run on)."""
    loopback_modal.lose_map_answers = loopback_modal.listing_down = True
    ids = [svc.submit(config_text(tiny_model_dir, tmp_path / n), [], "modal", {"gpu_count": 1})["id"] for n in "ab"]
    waiting = [until(svc, i, lambda j: j.reason == S.SUBMIT_UNKNOWN) for i in ids]
    assert [(j.state, j.reason, j.target_id) for j in waiting] == [(S.STARTING, S.SUBMIT_UNKNOWN, None)] * 2
    assert "cannot be asked now" in waiting[0].message, waiting[0].message
    maps = loopback_modal.seen.count("FunctionMap")
    for _ in range(5):
        svc.kick()
        time.sleep(0.05)
    assert loopback_modal.seen.count("FunctionMap") == maps  # never spawned again while unknown
    assert len(loopback_modal.live_calls()) >= 2  # control: Modal holds calls no record names yet
    svc.cancel(ids[1])
    loopback_modal.listing_down = False
    adopted = until(svc, ids[0], lambda j: j.target_id is not None and j.state == S.RUNNING)
    cancelled = until(svc, ids[1], lambda j: j.target_id is not None)
    first = {fid: [c.id for c in loopback_modal.calls if c.function_id == fid][0]
             for fid in dict.fromkeys(c.function_id for c in loopback_modal.calls)}  # fmt: skip
    assert (adopted.state, adopted.reason, adopted.target_id) == (S.RUNNING, None, list(first.values())[0])
    assert (cancelled.state, cancelled.target_id) == (S.CANCELLED, list(first.values())[1])
    deadline = time.monotonic() + 10
    while loopback_modal.live_calls() != [adopted.target_id] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert loopback_modal.live_calls() == [adopted.target_id], loopback_modal.calls
