"""The job page's buttons in a real headless Chromium (issue 22, items 3 and 4): a tab opened before
a service restart still stops a job after it (the CSRF key is kept in the database), and every
refused action shows the service's own message on the page (Stop on a finished job, a Resume the
API refuses, invalid Resources JSON, which is caught before anything is sent). Queued jobs behind
that running job (issue 39, item 5): their ETA (the running job's pace; "unknown" where no job has
finished here), a results part that says they have not started, Cancel only after its confirmation.

One service and one logged-in browser (conftest's `server` and `page`) serve every case of the module."""

from __future__ import annotations

import time

import yaml
from sse_starlette.sse import AppStatus

from scaletune.serve.jobs.db import Job
from tests.helpers import make_config, wait_for
from tests.serve.serve_helpers import client, dom, plant_job, wait_state

JOB = {"max_steps": 4, "save_every": 0, "micro_batch_size": 8}


def shown(driver, list_id: str) -> list[str]:

    return dom(driver, f"#{list_id} li", visible=True)


def test_invalid_resources_json_is_shown_and_nothing_is_submitted(server, page, tiny_model_dir, tmp_path):
    from selenium.webdriver.common.by import By

    c = client(server, server.submit)
    before = len(c.get("/api/jobs").json())
    page.get(server.url + "/")
    cfg = yaml.safe_dump(make_config(tiny_model_dir, tmp_path / "run", training=JOB))
    page.execute_script("document.getElementById('config').value = arguments[0]", cfg)
    field = page.find_element(By.ID, "resources")
    field.clear()
    field.send_keys('{"nodes": 2,')
    assert "Resources (JSON)" in "".join(dom(page, "#resources-problem"))  # said while typing
    page.find_element(By.ID, "submit").click()
    lines = wait_for(lambda: shown(page, "problems"), 10, "the Resources problem")
    assert any("Resources (JSON)" in t and "nothing was sent" in t for t in lines), lines
    # Valid JSON but not an object: refused in the form as well.
    field.clear()
    field.send_keys("[2, 8]")
    page.find_element(By.ID, "preview").click()
    wait_for(lambda: any("[2, 8]" in t for t in shown(page, "problems")), 10, "the not-an-object problem")
    assert len(c.get("/api/jobs").json()) == before
    assert "/jobs/" not in page.current_url


def test_refused_stop_and_resume_show_the_services_message(server, page, tiny_model_dir, tmp_path):
    """The control is the API itself: the same refusals asked with curl-like requests."""
    from selenium.webdriver.common.by import By

    c = client(server, server.submit)
    done = plant_job(server.svc, tmp_path / "done", state="succeeded")
    stop_api = c.post(f"/api/jobs/{done}/stop")
    resume_api = c.post(f"/api/jobs/{done}/resume", json={})
    assert (stop_api.status_code, resume_api.status_code) == (409, 422), (stop_api.text, resume_api.text)

    page.get(f"{server.url}/jobs/{done}")
    assert shown(page, "errors") == []
    page.find_element(By.ID, "stop").click()
    lines = wait_for(lambda: shown(page, "errors"), 10, "Stop's refusal on the page")
    assert "(409)" in lines[0], lines
    for problem in stop_api.json()["problems"]:
        assert any(problem in t for t in lines), (problem, lines)
    page.find_element(By.ID, "resume").click()
    lines = wait_for(lambda: "(422)" in " ".join(shown(page, "errors")) and shown(page, "errors"), 10, "Resume's")
    for problem in resume_api.json()["problems"]:
        assert any(problem in t for t in lines), (problem, lines)
    assert c.get(f"/api/jobs/{done}").json()["state"] == "succeeded"

    # A resumable job whose config no longer passes the checks: a 422 with several problems, every one shown.
    bad = make_config(tiny_model_dir, tmp_path / "bad", training=JOB)
    bad["model"]["dtype"] = "float99"
    bad["training"]["micro_batch_size"] = 0
    stopped = plant_job(server.svc, tmp_path / "stopped", state="stopped")
    with server.svc.Session() as s:
        s.get(Job, stopped).config_yaml = yaml.safe_dump(bad)
        s.commit()
    page.get(f"{server.url}/jobs/{stopped}")
    page.find_element(By.ID, "resume").click()
    lines = wait_for(lambda: shown(page, "errors"), 60, "the resume's problems")
    problems = c.post(f"/api/jobs/{stopped}/resume", json={}).json()["problems"]
    assert len(problems) >= 2, problems
    for problem in problems:
        assert any(problem in t for t in lines), (problem, lines)
    assert any("model.dtype" in t for t in lines) and any("training.micro_batch_size" in t for t in lines), lines
    assert c.get(f"/api/jobs/{stopped}").json()["state"] == "stopped"


def pace_left(lines: list[dict]) -> float:
    """The control of a running job's remaining time: its last PACE_LINES train lines' seconds a step
    times the steps left (computed here from the metrics API, not by the service's code)."""
    from scaletune.serve.jobs.records import PACE_LINES

    train = [m for m in lines if "eval_loss" not in m][-PACE_LINES:]
    first, last = train[0], train[-1]
    rate = (last["elapsed_s"] - first["elapsed_s"]) / (last["step"] - first["step"])
    return rate * (last["total_steps"] - last["step"])


def check_queued_jobs(server, page, c, running: str, cfg: dict, queued: list[str]) -> None:
    """Two jobs queued behind `running` (appended to `queued`; they never start: both are cancelled
    here): the first's ETA from the running job's pace, the second's unknown (no job has finished on
    this service), the results part saying the job has not started, and Cancel only after its
    confirmation."""
    from selenium.webdriver.common.by import By

    for n in range(2):
        r = c.post("/api/jobs", json={"config": yaml.safe_dump(cfg | {"output_dir": f"{cfg['output_dir']}-{n}"})})
        assert r.status_code == 201 and r.json()["state"] == "queued", r.text
        queued.append(r.json()["id"])
    wait_for(lambda: len(c.get(f"/api/jobs/{running}/metrics").json()) >= 3, 60, "three steps of the running job")
    page.get(f"{server.url}/jobs/{queued[0]}")
    page_eta = wait_for(lambda: (e := dom(page, "#eta", "data-start-in")) and e[0] and float(e[0]), 30, "the ETA")
    before = pace_left(c.get(f"/api/jobs/{running}/metrics").json())
    place = c.get(f"/api/jobs/{queued[0]}/queue").json()
    after = pace_left(c.get(f"/api/jobs/{running}/metrics").json())
    low, high = min(before, after), max(before, after)
    assert 0.7 * low <= place["start_in_s"] <= 1.3 * high, (place, before, after)
    assert 0.5 * low <= page_eta <= 1.5 * high, (page_eta, before, after)  # read a few seconds earlier
    assert place["position"] == 1 and place["ahead"][0]["id"] == running and "its pace" in place["why"]
    assert dom(page, "#eta")[0].startswith("about ") and dom(page, "#eta")[0].endswith(" to start")
    assert "number 1 in the queue, 1 job ahead" in dom(page, "#queue")[0]
    # Not "not on this machine": the job has not started yet.
    note = wait_for(lambda: "".join(dom(page, "#chat-note")), 30, "the results part's note")
    assert note == f"job {queued[0]} is queued: it has not started yet; its models are here once it has run"
    assert "not on this machine" not in "".join(dom(page, "#results"))
    assert dom(page, "#samples .empty") == ["no samples yet: the job has not started"]
    # Behind a queued job whose duration nothing here tells: unknown, saying why.
    page.get(f"{server.url}/jobs/{queued[1]}")
    wait_for(lambda: dom(page, "#eta") == ["unknown"], 30, "the unknown ETA")
    assert "no job has finished here to tell how long one takes" in dom(page, "#queue")[0]
    assert c.get(f"/api/jobs/{queued[1]}/queue").json()["start_in_s"] is None
    # Cancel asks first: the click alone changes nothing, "No" keeps the job, "Yes" cancels it.
    page.find_element(By.ID, "cancel").click()
    assert dom(page, "#cancel-confirm", visible=True) and dom(page, "#cancel", "aria-expanded") == ["true"]
    time.sleep(1)  # a one-click cancel (before) had reached the service by now
    assert c.get(f"/api/jobs/{queued[1]}").json()["state"] == "queued"
    page.find_element(By.ID, "cancel-no").click()
    assert not dom(page, "#cancel-confirm", visible=True)
    page.find_element(By.ID, "cancel").click()
    page.find_element(By.ID, "cancel-yes").click()
    wait_for(lambda: dom(page, "#state") == ["cancelled"], 30, "cancelled on the page")
    assert c.get(f"/api/jobs/{queued[1]}").json()["state"] == "cancelled" and not shown(page, "errors")
    assert c.post(f"/api/jobs/{queued[0]}/cancel").json()["state"] == "cancelled"


def test_tab_opened_before_a_restart_still_stops_the_job(server, page, tiny_model_dir, tmp_path):
    from selenium.webdriver.common.by import By

    c = client(server, server.submit)
    cfg = make_config(tiny_model_dir, tmp_path / "long", training={**JOB, "max_steps": 10000})
    job_id = c.post("/api/jobs", json={"config": yaml.safe_dump(cfg)}).json()["id"]
    queued: list[str] = []
    try:
        wait_state(c, job_id, {"running"}, timeout=120)
        check_queued_jobs(server, page, c, job_id, cfg, queued)
        page.get(f"{server.url}/jobs/{job_id}")
        wait_for(lambda: dom(page, "#state") == ["running"], 30, "the page showing running")
        # A new service on the same database; the tab is not reloaded. Its event stream ends as
        # SIGTERM ends it in a `scaletune serve` process (sse_starlette's exit flag); uvicorn in a
        # thread gets no signal and would wait for the stream instead.
        before = server.thread
        AppStatus.should_exit = True
        try:
            server.stop()
        finally:
            AppStatus.should_exit = False
        assert not before.is_alive(), "the first service still runs"
        server.start()
        c = client(server, server.submit)
        assert c.get(f"/api/jobs/{job_id}").json()["state"] == "running"
        page.find_element(By.ID, "stop").click()
        wait_for(
            lambda: c.get(f"/api/jobs/{job_id}").json()["state"] in ("stopping", "stopped") or shown(page, "errors"),
            30,
            "the stop to reach the service",
        )
        assert shown(page, "errors") == []
        assert c.get(f"/api/jobs/{job_id}").json()["state"] in ("stopping", "stopped")
        wait_for(lambda: dom(page, "#state") in (["stopping"], ["stopped"]), 30, "the page's state")
    finally:
        for j in (*queued, job_id):
            if c.get(f"/api/jobs/{j}").json()["state"] not in ("succeeded", "failed", "cancelled", "stopped"):
                c.post(f"/api/jobs/{j}/cancel")
