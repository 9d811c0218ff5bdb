"""The job API end to end on the tiny model with real training subprocesses: submit and stream,
stop and resume against an uninterrupted run, cancel, a service restart mid-run, bad input, auth."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import make_config, run_cli
from tests.serve.serve_helpers import client, read_events, wait_state

TERMINAL = {"succeeded", "failed", "cancelled", "stopped"}


# A job's training section over make_config's: 4 steps of one micro batch, no checkpoints.
JOB = {"max_steps": 4, "save_every": 0, "micro_batch_size": 8}


@pytest.fixture(scope="module")
def uninterrupted(server, tiny_model_dir, module_tmp_path):
    """The control: a 4-step job run through the API without interruption; its SSE stream."""
    out = module_tmp_path / "whole"
    c = client(server, server.submit)
    r = c.post("/api/jobs", json={"config": yaml.safe_dump(make_config(tiny_model_dir, out, training=JOB))})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    events = read_events(c, job_id, lambda k, d: k == "state" and d["state"] in TERMINAL)
    return job_id, out, events


def test_submit_streams_to_succeeded(server, uninterrupted):
    job_id, out, events = uninterrupted
    c = client(server, server.read)
    states = [d["state"] for _, k, d in events if k == "state"]
    # recorded while its config is checked, then queued (a submit answers 201 once the check ends)
    assert states[:2] == ["checking", "queued"] and "starting" in states and states[-1] == "succeeded", states
    assert {d["phase"] for _, k, d in events if k == "state" and d.get("phase")} >= {"loading model", "training"}
    metric_steps = [d["step"] for _, k, d in events if k == "metric"]
    assert metric_steps == [1, 2, 3, 4]
    assert server.svc.posted.get(job_id, 0) >= 4  # rank 0 posted its lines (the file is the fallback)
    ids = [int(i) for i, k, _ in events if k != "heartbeat"]  # a heartbeat repeats the last id
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert (out / "final" / "config.json").is_file()
    # Every metrics.jsonl line is in the API, as written.
    written = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert c.get(f"/api/jobs/{job_id}/metrics").json() == written
    assert [m["step"] for m in c.get(f"/api/jobs/{job_id}/metrics", params={"since_step": 2}).json()] == [3, 4]
    # Last-Event-ID: a reconnecting client gets exactly what followed.
    replay = read_events(c, job_id, lambda k, d: k == "state" and d["state"] == "succeeded", last_id=events[2][0])
    assert [e[:2] for e in replay if e[1] != "heartbeat"] == [e[:2] for e in events[3:] if e[1] != "heartbeat"]
    job = c.get(f"/api/jobs/{job_id}").json()
    assert job["step"] == 4 and job["last_metrics"]["loss"] == written[-1]["loss"]
    assert c.get(f"/api/jobs/{job_id}/artifacts/loss.png").content[:4] == b"\x89PNG"
    assert "final/config.json" in c.get(f"/api/jobs/{job_id}/artifacts/final").json()
    for bad in ("../../../etc/passwd", "final/../../x", "%2e%2e/%2e%2e/etc/passwd"):
        assert c.get(f"/api/jobs/{job_id}/artifacts/{bad}").status_code == 404


def test_stop_then_resume_matches_uninterrupted(server, uninterrupted, tiny_model_dir, tmp_path):
    _, whole, _ = uninterrupted
    c = client(server, server.submit)
    out = tmp_path / "stopped"
    job_id = c.post(
        "/api/jobs", json={"config": yaml.safe_dump(make_config(tiny_model_dir, out, training=JOB))}
    ).json()["id"]
    assert c.post(f"/api/jobs/{job_id}/stop").json()["state"] == "stopping"
    job = wait_state(c, job_id, TERMINAL)
    assert job["state"] == "stopped", job
    assert (out / "checkpoints" / "step-1").is_dir() and not (out / "final").exists()
    assert c.post(f"/api/jobs/{job_id}/resume", json={}).status_code == 200
    job = wait_state(c, job_id, TERMINAL)
    assert job["state"] == "succeeded", job
    got = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert got[-1]["loss"] == pytest.approx(ref[-1]["loss"], rel=1e-5, abs=1e-6)
    assert [m["step"] for m in c.get(f"/api/jobs/{job_id}/metrics").json()] == [1, 2, 3, 4]


def test_restart_reattaches_then_cancel_ends_it(server, tiny_model_dir, tmp_path):
    """A service restart mid-run: the new service finds the run (same PID), keeps reading its
    metrics, and its cancel ends the process it did not start."""
    c = client(server, server.submit)
    out = tmp_path / "long"
    job_id = c.post(
        "/api/jobs",
        json={"config": yaml.safe_dump(make_config(tiny_model_dir, out, training={**JOB, "max_steps": 400}))},
    ).json()["id"]
    read_events(c, job_id, lambda k, d: k == "metric")
    pid = int(c.get(f"/api/jobs/{job_id}").json()["target_id"])
    server.restart()  # a new service on the same database; the run goes on meanwhile
    c = client(server, server.submit)
    before = c.get(f"/api/jobs/{job_id}").json()
    assert before["state"] == "running" and before["target_id"] == str(pid), before
    events = read_events(c, job_id, lambda k, d: k == "metric" and d["step"] > before["step"] + 1)
    assert any(k == "log" and "re-attached: local" in d["line"] for _, k, d in events)
    assert c.post(f"/api/jobs/{job_id}/cancel").json()["state"] == "cancelled"
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    assert c.post(f"/api/jobs/{job_id}/stop").status_code == 409
    assert not (out / "final").exists()
    steps = [m["step"] for m in c.get(f"/api/jobs/{job_id}/metrics").json()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > before["step"]


def test_bad_config_lists_every_problem_like_the_cli(server, tiny_model_dir, tmp_path):
    cfg = make_config(tiny_model_dir, tmp_path / "bad", training=JOB)
    cfg["model"]["dtype"] = "float99"
    cfg["training"]["micro_batch_size"] = 0
    cfg["data"]["train"]["path"] = str(tmp_path / "missing.json")
    text = yaml.safe_dump(cfg)
    r = client(server, server.submit).post(
        "/api/jobs", json={"config": text, "overrides": ["training.learning_rate=x"]}
    )
    assert r.status_code == 422, r.text
    problems = r.json()["problems"]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    cli = run_cli(["train", str(path), "training.learning_rate=x", "--check"])
    assert cli.returncode == 2
    assert len(problems) >= 4, problems
    for p in problems:  # the same messages, but for the file's name
        assert p.split(": ", 1)[-1] in cli.stderr, (p, cli.stderr)
    assert not any(server.home.glob("*/config.yaml")) or all(
        "float99" not in p.read_text() for p in server.home.glob("*/config.yaml")
    )
    assert not (tmp_path / "bad").exists()


def test_dry_run_returns_plan_and_command(server, tiny_model_dir, tmp_path):
    c = client(server, server.submit)
    r = c.post(
        "/api/jobs",
        json={"config": yaml.safe_dump(make_config(tiny_model_dir, tmp_path / "dry", training=JOB)), "dry_run": True},
    )
    assert r.status_code == 200, r.text
    plan = r.json()["plan"]
    assert plan["strategy"] == "single" and plan["world_size"] == 1
    assert "/config.yaml " in plan["command"] and " -m scaletune train " in plan["command"]
    assert plan["command"].endswith(f"'output_dir=\"{tmp_path / 'dry'}\"'")  # the run directory, assigned last
    assert plan["memory_per_rank"]["per_rank_bytes"]["params"] > 0
    r = c.post(
        "/api/jobs",
        json={
            "config": yaml.safe_dump(make_config(tiny_model_dir, tmp_path / "dry", training=JOB)),
            "dry_run": True,
            "target": "slurm",
        },
    )
    assert "#SBATCH" in r.json()["plan"]["sbatch_script"]
    assert not (tmp_path / "dry").exists() and all(
        j["run_dir"] != str(tmp_path / "dry") for j in c.get("/api/jobs").json()
    )


def test_auth(server, uninterrupted, tiny_model_dir, tmp_path):
    job_id, out, _ = uninterrupted
    body = {"config": yaml.safe_dump(make_config(tiny_model_dir, tmp_path / "auth", training=JOB))}
    assert client(server, None).get("/api/jobs").status_code == 401
    assert client(server, "st_wrong").get("/api/jobs").status_code == 401
    assert client(server, server.read).get("/api/jobs").status_code == 200
    assert client(server, server.read).post("/api/jobs", json=body).status_code == 403
    assert client(server, server.read).post(f"/api/jobs/{job_id}/clone", json={}).status_code == 403
    # One job's report token cannot post to another job, nor call the API.
    other = client(server, server.submit).post("/api/jobs", json=body).json()["id"]
    # Its token is made when the job starts (the run has it in its environment); a busy machine may
    # start it a moment after the submit answers (CI at 5d2ae62 read it too early: KeyError).
    deadline = time.monotonic() + 120
    while other not in server.svc._tokens and time.monotonic() < deadline:
        time.sleep(0.1)
    token = server.svc._tokens[other]
    event = {"events": [{"kind": "metric", "data": {"step": 999, "loss": 1.0}}]}
    assert client(server, token).post(f"/api/jobs/{job_id}/report", json=event).status_code == 401
    assert client(server, token).get("/api/jobs").status_code == 401
    assert client(server, server.admin).post(f"/api/jobs/{job_id}/report", json=event).status_code == 401
    assert client(server, token).post(f"/api/jobs/{other}/report", json=event).json() == {"accepted": 1}
    assert client(server, server.submit).post(f"/api/jobs/{other}/cancel").json()["state"] == "cancelled"
    # The token is in no file the job or its run wrote.
    for root in (Path(server.home) / other, tmp_path / "auth"):
        for p in root.rglob("*"):
            if p.is_file():
                assert token.encode() not in p.read_bytes(), p
    assert os.environ.get("SCALETUNE_REPORT_TOKEN") is None


def test_a_vision_language_job_trains_on_its_images(server, tiny_vlm_dir, tmp_path):
    """A vision-language job through the service (issue 37): chat records with image parts
    (scikit-learn's digits as PNG files beside them, tests/helpers.py digit_chats) for the
    `idefics3-tiny` model, submitted as a config. It trains to the end; its final/ holds the
    processor; and the control, `scaletune eval` of final/ on the eval records (the command line, a
    process of its own), measures the eval loss the job logged at its end (1e-5)."""
    from tests.helpers import digit_chats

    digits = digit_chats(tmp_path / "digits", 8, 4)
    out = tmp_path / "vlm"
    cfg = {
        "model": {"name_or_path": str(tiny_vlm_dir), "dtype": "float32"},
        "data": {
            "train": {"path": str(digits["train"]), "format": "messages"},
            "eval": {"path": str(digits["eval"]), "format": "messages"},
            "max_seq_length": 64,
        },
        "training": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "learning_rate": 1e-2},
        "output_dir": str(out),
    }
    c = client(server, server.submit)
    r = c.post("/api/jobs", json={"config": yaml.safe_dump(cfg)})
    assert r.status_code == 201, r.text
    job = wait_state(c, r.json()["id"], TERMINAL)
    assert job["state"] == "succeeded", c.get(f"/api/jobs/{job['id']}/logs").text[-3000:]
    assert (out / "final" / "processor_config.json").is_file()
    logged = [m["eval_loss"] for m in c.get(f"/api/jobs/{job['id']}/metrics").json() if "eval_loss" in m]
    proc = run_cli(["eval", str(out / "final"), "--data", str(digits["eval"]), "--format", "messages", "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["loss"] == pytest.approx(logged[-1], rel=1e-5), (proc.stdout, logged)
