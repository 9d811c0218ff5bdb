"""`scaletune remote` (issue 22, the client for scripts and CI): the real CLI in a subprocess against
a real service (uvicorn on loopback, tokens in use), each answer compared with the API's own (and
the files the service has) as the control.

The jobs are a stand-in for `python -m scaletune train` run by the real local dispatcher (as in
test_watch.py; a tiny real training job costs about 45 s on 2 busy cores): it prints a log (UTF-8
beyond ASCII included), reports its phases in the trainer's words (`report.event_line`), writes
metrics.jsonl and a `final/` folder, and exits with the code it was made with."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import SHARED_DATA, make_config, run_cli, subprocess_env
from tests.serve.serve_helpers import TEST_POLICY, client, free_port, wait_state

TERMINAL = {"succeeded", "failed", "cancelled", "stopped"}

_STUB = """#!{python}
import json, os, sys, time
from pathlib import Path
from scaletune.report import event_line

run_dir = Path(json.loads(sys.argv[-1].split("=", 1)[1]))  # the service's last override: output_dir=
out = sys.stdout.buffer

def say(text):
    out.write(text.encode() + b"\\n")
    out.flush()

say(event_line("phase", {{"phase": "loading model"}}))
say("plain line: naïve café ✓ 日本")
run_dir.mkdir(parents=True, exist_ok=True)
say(event_line("phase", {{"phase": "training", "stage": "main"}}))
for step in range(1, {steps} + 1):
    time.sleep({hold})
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({{"step": step, "loss": 1.0 / step, "stage": "main"}}) + "\\n")
    say(f"step {{step}} done ✓")
if {code}:
    say("Traceback (most recent call last):")
    say("RuntimeError: the stand-in fails as asked")
    sys.exit({code})
(run_dir / "final").mkdir()
(run_dir / "final" / "config.json").write_text(json.dumps({{"model_type": "stand-in"}}))
(run_dir / "final" / "model.safetensors").write_bytes(os.urandom(300_000))
(run_dir / "final" / "tokenizer").mkdir()
(run_dir / "final" / "tokenizer" / "vocab.txt").write_text("a\\nb\\n")
out.write("the last line has no line end ✓".encode())
"""


def stub(root: Path, *, hold: float = 0.2, steps: int = 2, code: int = 0) -> str:
    path = root / f"stub-{hold}-{steps}-{code}"
    path.write_text(_STUB.format(python=sys.executable, hold=hold, steps=steps, code=code))
    path.chmod(0o755)
    return str(path)


def config_file(tiny_model_dir: Path, tmp_path: Path, name: str = "run") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(make_config(tiny_model_dir, tmp_path / name, training={"max_steps": 2})))
    return path


def remote(server, *args: str, token: str | None, url: bool = True, timeout: int = 120):
    """`scaletune remote ARGS` with the token in SCALETUNE_TOKEN ("" when None) and the address as
    --url (else in SCALETUNE_URL)."""
    env = {"SCALETUNE_TOKEN": token or "", "SCALETUNE_URL": "" if url else server.url}
    return run_cli(["remote", *args, *(["--url", server.url] if url else [])], env=env, timeout=timeout)


def secrets(server) -> list[str]:
    return [server.admin, server.read, server.submit]


@pytest.fixture(scope="module")
def done(server, tiny_model_dir, module_tmp_path):
    """One job submitted with `remote submit --wait` to its end: (job id, the CLI's answer)."""
    server.svc.dispatchers["local"].python = stub(module_tmp_path)
    proc = remote(server, "submit", str(config_file(tiny_model_dir, module_tmp_path)), "--wait", token=server.submit)
    return proc.stdout.splitlines()[0] if proc.stdout else None, proc


def test_submit_wait_exits_0_and_status_and_logs_are_the_apis(server, done):
    job_id, proc = done
    assert proc.returncode == 0, proc.stderr
    api = client(server, server.read)
    job = api.get(f"/api/jobs/{job_id}").json()
    assert (job["state"], job["exit_code"]) == ("succeeded", 0), job
    # What --wait followed: the states and steps of the stream, the end's summary.
    assert "running (training)" in proc.stderr and "step 2, loss 0.5" in proc.stderr, proc.stderr
    assert f"job {job_id} (run): succeeded" in proc.stderr

    status = remote(server, "status", job_id, "--json", token=server.read, url=False)  # SCALETUNE_URL
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout) == api.get(f"/api/jobs/{job_id}").json()
    human = remote(server, "status", job_id, token=server.read)
    assert human.stdout.startswith(f"job {job_id} (run): succeeded") and "step: 2" in human.stdout

    logs = remote(server, "logs", job_id, token=server.read)
    assert logs.returncode == 0, logs.stderr
    log_file = server.svc.home / job_id / "train.log"  # the file the dispatcher wrote: the control
    assert logs.stdout.encode() == log_file.read_bytes()
    assert logs.stdout == api.get(f"/api/jobs/{job_id}/logs", params={"offset": 0, "limit": 8 << 20}).text
    assert "naïve café ✓ 日本" in logs.stdout and logs.stdout.endswith("no line end ✓")
    for p in (proc, status, human, logs):
        assert not any(s in p.stdout + p.stderr for s in secrets(server))


def test_logs_follow_ends_with_the_job_and_prints_all_of_it(server, tiny_model_dir, tmp_path):
    """--follow started while the job runs: it prints what is appended and ends once the job has
    ended, with the whole log (lines cut across its reads printed once each)."""
    server.svc.dispatchers["local"].python = stub(tmp_path, hold=0.4, steps=6)
    sub = remote(server, "submit", str(config_file(tiny_model_dir, tmp_path)), token=server.submit)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip()
    follow = remote(server, "logs", job_id, "--follow", token=server.read)
    assert follow.returncode == 0, follow.stderr
    job = client(server, server.read).get(f"/api/jobs/{job_id}").json()
    assert job["state"] == "succeeded", job  # it waited for the end
    assert follow.stdout.encode() == (server.svc.home / job_id / "train.log").read_bytes()
    assert [ln for ln in follow.stdout.splitlines() if ln.startswith("step ")] == [
        f"step {i} done ✓" for i in range(1, 7)
    ]


def test_a_bad_config_exits_2_with_every_problem_of_the_apis_422(server, tiny_model_dir, tmp_path):
    cfg = make_config(tiny_model_dir, tmp_path / "bad", training={"max_steps": 2})
    cfg["model"]["dtype"] = "float99"
    cfg["training"]["micro_batch_size"] = 0
    cfg["data"]["train"]["path"] = str(tmp_path / "missing.json")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    control = client(server, server.submit).post(
        "/api/jobs", json={"config": path.read_text(), "overrides": ["training.learning_rate=x"]}
    )
    assert control.status_code == 422, control.text
    problems = control.json()["problems"]
    assert len(problems) >= 4, problems

    proc = remote(server, "submit", str(path), "training.learning_rate=x", "--wait", token=server.submit)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert f"({len(problems)} problems)" in proc.stderr and control.json()["detail"] in proc.stderr
    # Each submission is checked in a job folder of its own, which its problems name: that id aside,
    # the CLI prints the API's lines as they are.
    listed = re.sub(r"/jobs/[0-9a-f]{12}/", "/jobs/ID/", proc.stderr)
    for p in problems:
        assert "  - " + re.sub(r"/jobs/[0-9a-f]{12}/", "/jobs/ID/", p) in listed, (p, proc.stderr)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("code", [1, 2])
def test_a_failed_job_exits_with_its_outcome_and_its_log_tail(server, tiny_model_dir, tmp_path, code):
    """A run that fails exits 1; one that refused its input (exit 2: `failed (bad input)`) exits 2."""
    server.svc.dispatchers["local"].python = stub(tmp_path, code=code)
    proc = remote(server, "submit", str(config_file(tiny_model_dir, tmp_path)), "--wait", token=server.submit)
    job = client(server, server.read).get(f"/api/jobs/{proc.stdout.strip()}").json()
    assert (job["state"], job["exit_code"]) == ("failed", code), job
    assert proc.returncode == code, proc.stderr
    assert "RuntimeError: the stand-in fails as asked" in proc.stderr.split("--- the end of job")[1]
    assert f": failed ({job['reason']})" in proc.stderr


def test_a_cancelled_job_exits_1(server, tiny_model_dir, tmp_path):
    server.svc.dispatchers["local"].python = stub(tmp_path, hold=30.0)
    env = subprocess_env(SCALETUNE_TOKEN=server.submit, SCALETUNE_URL=server.url)
    cmd = [sys.executable, "-m", "scaletune", "remote", "submit", str(config_file(tiny_model_dir, tmp_path)), "--wait"]
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as waiting:
        job_id = waiting.stdout.readline().strip()
        api = client(server, server.submit)
        wait_state(api, job_id, {"running"}, timeout=60)
        assert api.post(f"/api/jobs/{job_id}/cancel").json()["state"] == "cancelled"
        out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 1, err
    assert f"job {job_id} (run): cancelled" in err


def test_download_gives_the_files_the_service_has(server, done, tmp_path):
    job_id, proc = done
    api = client(server, server.read)
    listing = api.get(f"/api/jobs/{job_id}/artifacts/final").json()
    run_dir = Path(api.get(f"/api/jobs/{job_id}").json()["run_dir"])
    assert sorted(listing) == ["final/config.json", "final/model.safetensors", "final/tokenizer/vocab.txt"]

    got = remote(server, "download", job_id, "-o", str(tmp_path / "model"), token=server.read)  # final/ by default
    assert got.returncode == 0, got.stderr
    files = sorted(str(p.relative_to(tmp_path / "model")) for p in (tmp_path / "model").rglob("*") if p.is_file())
    assert files == [p.removeprefix("final/") for p in sorted(listing)]
    for rel in listing:
        assert (tmp_path / "model" / rel.removeprefix("final/")).read_bytes() == (run_dir / rel).read_bytes()

    one = remote(server, "download", job_id, "metrics.jsonl", "-o", str(tmp_path / "m"), token=server.read)
    assert one.returncode == 0, one.stderr
    assert (tmp_path / "m" / "metrics.jsonl").read_bytes() == api.get(
        f"/api/jobs/{job_id}/artifacts/metrics.jsonl"
    ).content
    assert (tmp_path / "m" / "metrics.jsonl").read_bytes() == (run_dir / "metrics.jsonl").read_bytes()

    outside = remote(server, "download", job_id, "../x", "-o", str(tmp_path / "x"), token=server.read)
    assert outside.returncode == 2 and "ARTIFACT '../x'" in outside.stderr
    missing = remote(server, "download", job_id, "checkpoints", "-o", str(tmp_path / "c"), token=server.read)
    assert missing.returncode == 2 and "checkpoints: not written (yet)" in missing.stderr, missing.stderr


def test_tokens_come_from_the_environment_and_never_show(server, done, tiny_model_dir, tmp_path):
    job_id, _ = done
    wrong = "st-wrong-" + "x" * 30
    procs = {
        "wrong": remote(server, "status", job_id, token=wrong),
        "none": remote(server, "status", job_id, token=None),
        "read submits": remote(server, "submit", str(config_file(tiny_model_dir, tmp_path)), token=server.read),
        "on the command line": run_cli(["remote", "status", job_id, "--url", server.url, "--token", server.read]),
    }
    assert all(p.returncode == 2 for p in procs.values()), {k: p.stderr for k, p in procs.items()}
    assert "refused the token in SCALETUNE_TOKEN (invalid token)" in procs["wrong"].stderr
    assert "needs a token" in procs["none"].stderr and "set SCALETUNE_TOKEN" in procs["none"].stderr
    assert "this token's scope is read; submit is needed" in procs["read submits"].stderr
    assert "No such option: --token" in procs["on the command line"].stderr
    for p in procs.values():
        assert "Traceback" not in p.stderr
        assert not any(s in p.stdout + p.stderr for s in [wrong, *secrets(server)])
    assert not [j for j in client(server, server.read).get("/api/jobs").json() if j["run_dir"] == str(tmp_path / "run")]
    helped = run_cli(["remote", "status", "--help"], env={"COLUMNS": "1000", "TERMINAL_WIDTH": "1000"})
    assert "SCALETUNE_TOKEN" in helped.stdout and "shell history" in helped.stdout


def test_an_unreachable_service_is_one_line_and_exit_1():
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    proc = run_cli(["remote", "status", "abc", "--url", url], env={"SCALETUNE_TOKEN": "st-secret-token"})
    assert proc.returncode == 1 and time.monotonic() - start < 30
    assert proc.stderr.startswith(f"error: cannot reach the service at {url}: ConnectError")
    assert "Traceback" not in proc.stderr and "st-secret-token" not in proc.stderr


@pytest.mark.parametrize("listed", ["final/../../evil", "/etc/evil", "other/evil", "final"])
def test_a_listing_outside_the_folder_is_refused(tmp_path, listed):
    """A service (or something posing as one) that lists a path outside the folder asked for
    cannot make the client write outside DEST. The real service never lists one (its listing is
    confined to the run directory), so this answer is made up: httpx's own transport serves it."""
    import httpx

    from scaletune.remote.client import Client, RemoteError
    from scaletune.remote.follow import download

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/artifacts/final"):
            return httpx.Response(200, json=[listed])
        return httpx.Response(200, content=b"x", headers={"content-disposition": 'attachment; filename="evil"'})

    dest = tmp_path / "a" / "b" / "dest"
    with Client("http://st.test", "tok", transport=httpx.MockTransport(answer)) as c:
        with pytest.raises(RemoteError, match="not a file inside it"):
            download(c, "job1", "final", dest, lambda s: None)
        assert not any(p.is_file() for p in tmp_path.rglob("*"))
        listed = "final/sub/ok"  # the control: a path inside is written where it belongs
        assert download(c, "job1", "final", dest, lambda s: None) == [dest / "sub" / "ok"]
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [dest / "sub" / "ok"]


def test_a_check_longer_than_the_timeout_makes_one_job_and_says_where_it_is(server, tiny_model_dir, tmp_path):
    """Issue 40, item 2: `remote submit --timeout 6 --wait` of a config whose check (the preflight)
    takes longer: 800,000 records to read, the stand-in for a service slowed by load, and two
    problems only the check finds. The answer comes within the timeout, `checking`, with the job's
    id and where to follow it; the check goes on at the service and the job fails `bad input` with
    every problem (`--wait` exits 2, the problems in the log tail it prints). Before, a check longer
    than the client's fixed 60 s read as an unreachable service while the job was made, and a second
    submit made another. A good config sent twice with one request id is one job. GET /api/jobs and
    the database's state events are the control."""
    import json as _json

    server.svc.dispatchers["local"].python = stub(tmp_path)
    records = _json.loads((SHARED_DATA / "alpaca_5000.json").read_text())
    with (tmp_path / "big.jsonl").open("w") as f:
        for _ in range(160):
            f.writelines(_json.dumps(r) + "\n" for r in records)
    bad = make_config(tiny_model_dir, tmp_path / "bad", training={"max_steps": 2, "micro_batch_size": 0})
    bad["model"]["dtype"] = "float99"
    bad["data"]["train"] = {"path": str(tmp_path / "big.jsonl"), "format": "alpaca"}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    api = client(server, server.read)
    before = {j["id"] for j in api.get("/api/jobs").json()}

    start = time.monotonic()
    proc = remote(server, "submit", str(tmp_path / "bad.yaml"), "--timeout", "6", "--wait", token=server.submit)
    job_id = proc.stdout.strip()
    assert proc.returncode == 2, proc.stderr
    assert f"job {job_id}: the service is still checking its config" in proc.stderr, proc.stderr
    assert f"{server.url}/jobs/{job_id}" in proc.stderr and "Traceback" not in proc.stderr
    assert f"job {job_id} (bad): failed (bad input)" in proc.stderr
    tail = proc.stderr.split("--- the end of job")[1]
    assert "training.micro_batch_size: Input should be" in tail and "model.dtype: Input should be" in tail, tail
    states = [d["state"] for d in _state_events(server.svc.Session, job_id)]
    assert states == ["checking", "failed"], states
    # The check outlasted the service's wait (6 - min(10, 6 / 2) = 3 s): the answer came before it ended.
    assert time.monotonic() - start > 3

    good = config_file(tiny_model_dir, tmp_path, "good")
    first = remote(server, "submit", str(good), "--request-id", "ci-42", "--wait", token=server.submit)
    assert first.returncode == 0, first.stderr
    again = remote(server, "submit", str(good), "--request-id", "ci-42", token=server.submit)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    good_id = first.stdout.strip()
    assert f"job {good_id} was submitted before with request id ci-42 (now succeeded); no second job" in again.stderr
    made = {j["id"] for j in api.get("/api/jobs").json()} - before
    assert made == {job_id, good_id}, made
    for p in (proc, first, again):
        assert not any(s in p.stdout + p.stderr for s in secrets(server))


def test_an_answer_before_the_check_ends_is_202_and_the_job_goes_on(server, tiny_model_dir, tmp_path):
    """POST /api/jobs with `wait_s: 0`: 202 `checking` at once; the check goes on and queues the job,
    which runs to its end (states checking, queued, starting, running, succeeded)."""
    server.svc.dispatchers["local"].python = stub(tmp_path)
    body = {"config": config_file(tiny_model_dir, tmp_path).read_text(), "wait_s": 0}
    r = client(server, server.submit).post("/api/jobs", json=body)
    assert r.status_code == 202 and r.json()["state"] == "checking", r.text
    job_id = r.json()["id"]
    job = wait_state(client(server, server.read), job_id, TERMINAL)
    assert job["state"] == "succeeded", job
    states = [d["state"] for d in _state_events(server.svc.Session, job_id)]
    changes = [st for i, st in enumerate(states) if i == 0 or states[i - 1] != st]  # a phase repeats its state
    assert changes == ["checking", "queued", "starting", "running", "succeeded"], states


def _state_events(Session, job_id: str) -> list[dict]:
    from sqlalchemy import select

    from scaletune.serve.jobs.db import Event

    with Session() as s:
        rows = s.scalars(select(Event).where(Event.job_id == job_id, Event.kind == "state").order_by(Event.id))
        return [e.data for e in rows]


def test_a_job_left_checking_by_a_stopped_service_is_checked_again_at_start(tiny_model_dir, tmp_path):
    """A service that stopped during a check left its job `checking` (its record and folder, as
    `JobService.submit` writes them before the check). The next service on that database checks it
    again when it starts: the job is queued and runs to its end; a second one whose config is bad
    fails `bad input` with its problem in its message."""
    from scaletune.serve.jobs.service import JobService

    db, home = f"sqlite:///{tmp_path / 'serve.db'}", tmp_path / "jobs"
    first = JobService(db, home, "http://127.0.0.1:1", policy=TEST_POLICY)  # never started: it "stopped"
    good = config_file(tiny_model_dir, tmp_path, "good").read_text()
    bad = config_file(tiny_model_dir, tmp_path, "bad").read_text().replace("max_steps: 2", "max_steps: -2")
    assert bad != good
    left = {}
    for name, text in (("good", good), ("bad", bad)):
        job, _, _, _ = first.draft_job(text, [], "local", {})
        with first.lock, first.Session() as s:
            s.add(job)
            s.commit()
        left[name] = job.id
    first.shutdown()

    again = JobService(db, home, "http://127.0.0.1:1", policy=TEST_POLICY)
    again.dispatchers["local"].python = stub(tmp_path)
    again.start()
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            jobs = {n: again.get(i) for n, i in left.items()}
            if all(j.state in TERMINAL for j in jobs.values()):
                break
            time.sleep(0.3)
        assert (jobs["good"].state, jobs["bad"].state, jobs["bad"].reason) == ("succeeded", "failed", "bad input")
        assert "training.max_steps" in jobs["bad"].message, jobs["bad"].message
        changes = [d["state"] for d in _state_events(again.Session, left["good"])]
        assert changes[:2] == ["queued", "starting"], changes  # planted without its `checking` event
    finally:
        again.shutdown()
