"""The service's policy (issue 21, item 1): a `submit` token runs no code of its own in the service.
By default a config naming a factory, remote code, a loader variable, data outside the read roots
or a run directory outside the jobs folder is refused with 422 naming the rule, before anything of
it is imported (a payload that would leave a marker file leaves none); with factories allowed by
the admin, the check imports the factory in a child process, never in the service."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import yaml

from scaletune.serve.edge.auth import create_token
from scaletune.serve.edge.policy import Policy
from tests.helpers import make_config
from tests.serve.serve_helpers import (
    REPO_ROOT,
    TEST_POLICY,
    Server,
    client,
    free_port,
    plant_job,
    wait_serving,
    wait_state,
)


@pytest.fixture(scope="module")
def strict(module_tmp_path):
    """A service with the default policy (what `scaletune serve` starts with)."""
    srv = Server(f"sqlite:///{module_tmp_path / 'db.sqlite'}", module_tmp_path / "jobs", policy=Policy())
    srv.submit = create_token(srv.svc.Session, "submit")
    yield srv
    srv.stop()


def post(srv, cfg: dict, overrides=(), dry_run=True) -> httpx.Response:
    body = {"config": yaml.safe_dump(cfg), "overrides": list(overrides), "dry_run": dry_run}
    return client(srv, srv.submit).post("/api/jobs", json=body)


def refused(r: httpx.Response, rule: str) -> list[str]:
    assert r.status_code == 422, r.text
    problems = r.json()["problems"]
    assert any(p.startswith(f"policy: {rule}") for p in problems), problems
    return problems


def test_factory_and_remote_code_refused_before_import(strict, tiny_model_dir, tmp_path):
    marker = tmp_path / "ran"
    cfg = make_config(tiny_model_dir, "runs/x")
    cfg["model"] |= {"factory": "os:system", "factory_kwargs": {"command": f"touch {marker}"}}
    refused(post(strict, cfg), "model.factory")
    refused(post(strict, cfg, dry_run=False), "model.factory")
    cfg = make_config(tiny_model_dir, "runs/x")
    refused(
        post(strict, cfg, ["data.factory=os:system", f"data.factory_kwargs={{command: touch {marker}}}"]),
        "data.factory",
    )
    refused(post(strict, cfg, ["model.trust_remote_code=true"]), "model.trust_remote_code")
    time.sleep(0.5)
    assert not marker.exists()
    assert not list(strict.home.iterdir()), "a refused job left a folder"


def test_a_submitted_mlflow_tracking_uri_is_refused(strict):
    """Issue 39 item 17: `logging.mlflow.tracking_uri` chooses an endpoint or a store path, as
    WANDB_BASE_URL would: refused (no setting allows it), where `logging.mlflow` without one passes
    the policy (the job logs to the service's MLFLOW_TRACKING_URI). The model is outside the read
    roots, so both answers are the policy's 422; the assertions are about which keys it names."""
    cfg = make_config(REPO_ROOT / "examples", "runs/x")
    cfg["model"]["name_or_path"] = "/etc"
    cfg["logging"] = {"mlflow": {"tracking_uri": "http://attacker.example:5000", "experiment": "x"}}
    problems = refused(post(strict, cfg), "logging.mlflow.tracking_uri")
    assert any("no setting allows it" in p for p in problems if "mlflow" in p), problems
    cfg["logging"] = {"mlflow": {"experiment": "x"}}
    r = post(strict, cfg)
    assert r.status_code == 422 and not any("mlflow" in p for p in r.json()["problems"]), r.text


def test_reward_functions_are_user_code_but_the_builtins(strict, tmp_path):
    """Issue 36: a reward function is submitted code, like a factory. Any `rl.rewards[*].function`
    but the exact name of a built-in (`scaletune.rewards:NAME`, NAME in the package's `__all__`) is
    refused before it is imported: at the top level, in a stage, from an override, a look-alike of a
    built-in too. The built-ins pass. With --allow-factories the rule is off, and such a job's check
    goes to a child process. (The model is outside the read roots, so every answer here is the
    policy's 422, cheap: the assertions are about which keys it names.)"""
    from scaletune import rewards
    from scaletune.serve.edge import policy as P
    from scaletune.serve.jobs.checking import in_child

    marker = tmp_path / "ran"
    planted = tmp_path / "planted_reward.py"
    planted.write_text(
        f"open({str(marker)!r}, 'w').write('imported')\n"
        "def reward(prompts, completions, **_):\n    return [0.0] * len(completions)\n"
    )
    builtins = [{"function": f"scaletune.rewards:{name}", "kwargs": {}} for name in rewards.__all__]
    assert len(builtins) == 3
    user = [f"{planted}:reward", "os:system", "scaletune.rewards.builtin:normalise"]
    cfg = make_config(REPO_ROOT / "examples", "runs/x")
    cfg["model"]["name_or_path"] = "/etc"
    cfg["training"]["rl"] = {"rewards": [*builtins, *({"function": f} for f in user)]}
    problems = refused(post(strict, cfg), "training.rl.rewards.3.function")
    said = [p for p in problems if ".rewards." in p]
    assert [p.split(":")[1].strip() for p in said] == [f"training.rl.rewards.{i}.function" for i in (3, 4, 5)], said
    assert all("--allow-factories" in p for p in said), said

    cfg["training"]["rl"] = {"rewards": builtins}
    cfg["stages"] = [{"name": "rl", "training": {"rl": {"rewards": [*builtins, {"function": f"{planted}:reward"}]}}}]
    problems = refused(post(strict, cfg), "stages.0.training.rl.rewards.3.function")
    assert len([p for p in problems if ".rewards." in p]) == 1, problems
    del cfg["stages"]
    override = f"training.rl.rewards=[{{function: '{planted}:reward'}}]"
    refused(post(strict, cfg, [override], dry_run=False), "training.rl.rewards.0.function")

    r = post(strict, cfg)  # the built-ins alone
    assert r.status_code == 422 and not any(".rewards." in p for p in r.json()["problems"]), r.text
    time.sleep(0.5)
    assert not marker.exists(), "a refused reward function was imported"
    assert not list(strict.home.iterdir()), "a refused job left a folder"

    # The admin's setting: the rule is off, and the job's check runs in a child process.
    data = {"training": {"rl": {"rewards": [*builtins, {"function": f"{planted}:reward"}]}}}
    places = P.Places(tmp_path / "jobs", tmp_path / "jobs" / "j", None)
    assert any(".rewards." in p for p in P.check(data, Policy(), places)[0])
    assert not any(".rewards." in p for p in P.check(data, Policy(allow_factories=True), places)[0])
    assert in_child(data) and not in_child({"training": {"rl": {"rewards": builtins}}})


@pytest.mark.parametrize(
    "name",
    [
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "PATH",
        "BASH_ENV",
        "HF_DATASETS_TRUST_REMOTE_CODE",
        # issue 34: where a job connects, caches, reads a token, or which plugin/library it loads
        "HF_ENDPOINT",
        "HF_HUB_CACHE",
        "HF_HOME",
        "HF_TOKEN_PATH",
        "WANDB_BASE_URL",
        "NCCL_NET_PLUGIN",
        "NCCL_TUNER_PLUGIN",
        "CUDA_INJECTION64_PATH",
        "TORCH_EXTENSIONS_DIR",
        "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD",
    ],
)
def test_loader_variables_refused(strict, tiny_model_dir, name):
    cfg = make_config(tiny_model_dir, "runs/x")
    cfg["distributed"]["env"] = {name: "/tmp/evil", "NCCL_DEBUG": "WARN"}
    problems = refused(post(strict, cfg), f"distributed.env.{name}")
    assert not any("NCCL_DEBUG" in p for p in problems)  # the allow-list lets it through


def test_every_listed_variable_passes_and_the_admin_adds_names(strict, tiny_model_dir):
    """The names a job may set (JOB_ENV, each with its reason) pass the policy together; an admin's
    --allow-env adds a name; nothing allows turning the restricted unpickler off."""
    from scaletune.serve.edge.policy import JOB_ENV

    cfg = make_config(tiny_model_dir, "runs/x")
    cfg["distributed"]["env"] = dict.fromkeys(JOB_ENV, "1")
    r = post(strict, cfg)
    assert not any("distributed.env" in p for p in r.json().get("problems", [])), r.text
    cfg["distributed"]["env"] = {"HF_ENDPOINT": "https://hub.example", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    before = strict.svc.policy
    strict.svc.policy = before.updated(env_prefixes=["HF_ENDPOINT", "TORCH_"])
    try:
        problems = refused(post(strict, cfg), "distributed.env.TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    finally:
        strict.svc.policy = before
    assert not any("HF_ENDPOINT" in p for p in problems), problems


def test_reads_outside_the_roots_refused(strict, tmp_path):
    """The default read root is the service's working directory: a model or data elsewhere (here
    the temporary folder, as /etc or a home would be) is refused; the repo's own data is not."""
    data = tmp_path / "secret.json"
    data.write_text("[]")
    cfg = make_config(REPO_ROOT / "examples", "runs/x")
    cfg["model"]["name_or_path"] = "/etc"
    cfg["data"]["train"]["path"] = str(data)
    problems = refused(post(strict, cfg, ["training.resume=/root"]), "model.name_or_path")
    assert any(p.startswith("policy: data.train.path") for p in problems), problems
    assert any(p.startswith("policy: training.resume") for p in problems), problems
    # What objectives read: a distillation teacher's folder, a replayed rollouts.jsonl (a stage's too).
    cfg = make_config(REPO_ROOT / "examples", "runs/x")
    cfg["training"]["distill"] = {"teacher": "/etc"}
    cfg["stages"] = [
        {"name": "a", "training": {"rl": {"engine": "replay", "replay": str(data)}}},
        {"name": "b", "training": {"distill": {"mode": "on_policy", "engine": "replay", "replay": str(data)}}},
    ]
    problems = refused(post(strict, cfg), "training.distill.teacher")
    assert any(p.startswith("policy: stages.0.training.rl.replay") for p in problems), problems
    assert any(p.startswith("policy: stages.1.training.distill.replay") for p in problems), problems


@pytest.mark.parametrize("where", ["etc", "service", "other job", "escape", "jobs"])
def test_run_area_confined(strict, tiny_model_dir, where):
    other = plant_job(strict.svc, strict.home / "planted" / "run")
    out = {
        "etc": "/etc/scaletune-run",
        "service": str(strict.home.parent),  # the database's folder
        "other job": str(strict.home / "planted" / "run"),
        "escape": "../../x",
        "jobs": str(strict.home),
    }[where]
    try:
        cfg = make_config(tiny_model_dir, out)
        refused(post(strict, cfg), "output_dir")
    finally:
        with strict.svc.Session() as s:
            from scaletune.serve.jobs.db import Job

            s.delete(s.get(Job, other))
            s.commit()


def test_overwrite_cannot_touch_another_jobs_run(strict, tiny_model_dir):
    """`overwrite: true` naming a finished job's run directory: refused, the run left as it was."""
    run = strict.home / "finished" / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "model.safetensors").write_bytes(b"weights")
    (run / ".scaletune-run").write_text('{"format": 1}\n')  # a run scaletune made: overwrite may clear it
    plant_job(strict.svc, run)
    cfg = make_config(tiny_model_dir, str(run))
    cfg["overwrite"] = True
    refused(post(strict, cfg, dry_run=False), "output_dir")
    time.sleep(5)
    assert (run / "final" / "model.safetensors").read_bytes() == b"weights"


def test_default_cli_service_refuses_a_factory(tmp_path):
    """`scaletune serve` as a user starts it: its default policy refuses `model.factory: os:system`."""
    marker = tmp_path / "ran"
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)])}
    db = f"sqlite:///{tmp_path / 'serve.db'}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "scaletune",
            "serve",
            "--port",
            str(port),
            "--db",
            db,
            "--jobs-dir",
            str(tmp_path / "j"),
        ],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_serving(proc, url)
        cfg = {
            "output_dir": "x",
            "model": {"factory": "os:system", "factory_kwargs": {"command": f"touch {marker}"}},
            "data": {"dummy": {}},
        }
        r = httpx.post(url + "/api/jobs", json={"config": yaml.safe_dump(cfg), "dry_run": True}, timeout=120)
        refused(r, "model.factory")
        assert not marker.exists()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_allowed_factory_is_checked_in_a_child(tmp_path, monkeypatch, tiny_model_dir):
    """With --allow-factories the factory is imported by the check, in a child process: the
    module records the PID that imported it, and it is not the service's; and the environment it
    sees, which holds none of the service's own secrets (issue 34: the check child inherited them)."""
    from cryptography.fernet import Fernet

    from scaletune.serve.jobs.dispatch.base import SERVICE_SECRETS
    from scaletune.serve.jobs.vault import KEY_ENV

    for secret in SERVICE_SECRETS:
        monkeypatch.setenv(secret, f"service-own-{secret.lower()}-5c1e")
    monkeypatch.setenv(KEY_ENV, Fernet.generate_key().decode())  # a key that is none stops the start
    name = f"planted_factory_{uuid.uuid4().hex[:8]}"
    marker, seen = tmp_path / "imported-by", tmp_path / "environment"
    (tmp_path / f"{name}.py").write_text(
        f"import json, os\nopen({str(marker)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
        f"open({str(seen)!r}, 'w').write(json.dumps(dict(os.environ)))\n"
        "def build(**kw):\n    raise ValueError('planted factory: no model')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO_ROOT / "src"), str(REPO_ROOT)]))
    policy = TEST_POLICY.updated(allow_factories=True) if hasattr(TEST_POLICY, "updated") else None
    srv = Server(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs", policy=policy)
    srv.submit = create_token(srv.svc.Session, "submit")
    try:
        cfg = make_config(tiny_model_dir, "runs/x")
        cfg["model"] = {"factory": f"{name}:build", "dtype": "float32"}
        r = post(srv, cfg)
        assert r.status_code in (200, 422), r.text
        assert marker.is_file(), "the check never imported the factory"
        pids = {int(x) for x in marker.read_text().split()}
        assert os.getpid() not in pids and name not in sys.modules
        env = json.loads(seen.read_text())
        assert not SERVICE_SECRETS & set(env), sorted(SERVICE_SECRETS & set(env))
        assert not any("service-own-" in v for v in env.values())
        assert env.get("PYTHONPATH")  # the control: the rest of the service's environment is there
    finally:
        srv.stop()


@pytest.mark.parametrize("builder", ["text", "json", "csv"])
def test_a_builder_name_as_data_is_refused(strict, tiny_model_dir, builder):
    """`data.train.path: text` is not a file: datasets' builder would read every *train* file under
    the service's working directory, past the read roots (issue 34). Refused with 422, by name."""
    cfg = make_config(tiny_model_dir, "runs/x")
    cfg["data"]["train"] = {"path": builder, "format": "text"}
    before = strict.svc.policy
    strict.svc.policy = TEST_POLICY  # the model's folder readable: only the data is wrong
    try:
        r = post(strict, cfg)
    finally:
        strict.svc.policy = before
    assert r.status_code == 422, r.text
    assert any("names a datasets builder" in p and builder in p for p in r.json()["problems"]), r.text


def test_a_target_turned_off_is_refused(strict, tiny_model_dir):
    """`--disable-target local` (a web-only deployment that sends every run elsewhere): a job for
    it is 422 naming the setting, the other targets are still accepted (issue 34); an unknown name
    is refused at start, with every bad `--job-secret` in the same message."""
    from tests.helpers import run_cli

    cfg = make_config(tiny_model_dir, "runs/x")
    before = strict.svc.policy
    strict.svc.policy = TEST_POLICY.updated(disabled_targets=["local"])
    try:
        body = {"config": yaml.safe_dump(cfg), "dry_run": True, "target": "local"}
        r = client(strict, strict.submit).post("/api/jobs", json=body)
        assert r.status_code == 422 and any("target local: turned off" in p for p in r.json()["problems"]), r.text
        r = client(strict, strict.submit).post("/api/jobs", json={**body, "target": "slurm"})
        assert not any("turned off" in p for p in r.json().get("problems", [])), r.text
    finally:
        strict.svc.policy = before
    # The start's refusals in one call: an unknown target, and every kind of bad --job-secret (the
    # form, the service's own secret handed on, a variable the service lacks).
    bad = run_cli(
        ["serve", "--disable-target", "nowhere", "--port", "1"]
        + [
            "--job-secret",
            "no-form",
            "--job-secret",
            "*:X=SCALETUNE_ADMIN_TOKEN",
            "--job-secret",
            "bob:Y=UNSET_VAR_9F",
        ],
        env={"SCALETUNE_ADMIN_TOKEN": "x" * 40},
    )
    assert bad.returncode == 2, bad.stderr
    for said in (
        "--disable-target 'nowhere'",
        "--job-secret 'no-form': expected OWNER:NAME=VAR",
        "--job-secret '*:X=SCALETUNE_ADMIN_TOKEN': SCALETUNE_ADMIN_TOKEN is the service's own secret",
        "--job-secret 'bob:Y=UNSET_VAR_9F': the service's environment has no UNSET_VAR_9F",
    ):
        assert said in bad.stderr, bad.stderr
    assert "x" * 40 not in bad.stdout + bad.stderr


def test_a_module_planted_in_the_working_directory_is_never_imported(tmp_path, tiny_model_dir):
    """A `scaletune.py` written into the service's working directory (issue 34, case 1: a hostile
    hub's download into a cache a job named there) is not what a job's processes import: they start
    with PYTHONSAFEPATH (no working directory first on sys.path), and the job trains. The control:
    a plain `python -m scaletune` in that directory imports the planted file."""
    from tests.helpers import SHARED_DATA

    marker = tmp_path / "planted-ran"
    (tmp_path / "scaletune.py").write_text(f"open({str(marker)!r}, 'a').write('ran\\n')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)])}
    subprocess.run([sys.executable, "-m", "scaletune", "--help"], env=env, cwd=tmp_path, capture_output=True)
    assert marker.is_file(), "the control: a plain `python -m scaletune` there imports the plant"
    marker.unlink()
    port = free_port()
    roots = ["--read-root", str(tiny_model_dir.parent), "--read-root", str(SHARED_DATA)]
    # The service itself started safely (-P), as an operator starts it outside a writable folder.
    argv = [sys.executable, "-P", "-m", "scaletune", "serve", "--port", str(port), "--jobs-dir", str(tmp_path / "j")]
    proc = subprocess.Popen(
        [*argv, *roots],
        env={**env, "SCALETUNE_DB": f"sqlite:///{tmp_path / 'serve.db'}"},
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_serving(proc, url)
        cfg = make_config(tiny_model_dir, "x", training={"max_steps": 1, "save_every": 0})
        with httpx.Client(base_url=url, timeout=120) as c:
            r = c.post("/api/jobs", json={"config": yaml.safe_dump(cfg)})
            assert r.status_code == 201, r.text
            job = wait_state(c, r.json()["id"], {"succeeded", "failed", "cancelled", "lost"}, timeout=300)
            assert job["state"] == "succeeded", c.get(f"/api/jobs/{job['id']}/logs").text[-2000:]
        assert not marker.exists(), "the job's processes imported the planted scaletune.py"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
