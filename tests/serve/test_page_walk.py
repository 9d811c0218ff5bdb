"""The whole path a person takes through the page, in one real headless Chromium against one real
service running real jobs (issue 23's "done when", and issue 39's: from an uploaded `messages` file
and the form alone, no YAML typed): upload a chat file, preview it, fill the form (model, "use this
file", steps, method, learning rate), watch the plan preview change, submit, watch the chart, stop,
resume, chat with the result, evaluate it, export it, push the export to a Hub, download it, clone
the job with other settings, compare the two, delete the clone — at desktop width, then the job
page at a phone's.

Each step is checked against something the page did not compute: the upload against the file's
records, the plan against the dry run the API gives for the same YAML, the chart against
/api/jobs/ID/metrics, the chat's answer against `scaletune generate` on the same run, the
evaluation against `scaletune eval`, the archive against the exported folder, the Hub's commit (a
loopback Hub, `tests.helpers.LoopbackHub`) against the exported folder and the token it was sent
against the one the operator mapped to the owner, which no file of the service holds; the compare
page's summary against /api/jobs/ID/metrics/summary, the deletion against the API (404) and the disk.

Data: the first 48 Alpaca records as two-turn conversations (`{"messages": [user, assistant]}`).

With SCALETUNE_SCREENSHOT_DIR=docs/img the screenshots refresh the ones docs/serve.md shows
(`page-walk-*.png`)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest
import yaml

from scaletune.serve.edge.auth import create_token
from tests.helpers import ALPACA_5000, LoopbackHub, run_cli, wait_for
from tests.serve.serve_helpers import (
    CHROMIUM,
    DRIVER,
    NO_BROWSER,
    TEST_POLICY,
    Server,
    client,
    dom,
    headless_chromium,
    need,
    wait_state,
)

PROMPT = "Give three tips for staying healthy."
HUB_TOKEN = "hf_scaletuneWALK0123456789abcdefghijkl"
# The job's steps (precision `auto`, float32 on the CPU: a stop after the chart's third point lands
# well before the end) and its clone's.
STEPS, CLONE_STEPS = 40, 4


def _conversations(n: int) -> list[dict]:
    """The first `n` Alpaca records as chat conversations: the instruction (and its input) from the
    user, the output from the assistant."""
    with open(ALPACA_5000) as f:
        data = json.load(f) if str(ALPACA_5000).endswith(".json") else [json.loads(line) for line in f]
    out = []
    for r in data[:n]:
        user = r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")
        out.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": r["output"]}]})
    return out


def _value(driver, css: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, css).get_attribute("value")


def _type(driver, element_id: str, text: str) -> None:
    """Replace a field's value as a person would (select all, type), so its input handlers run."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    field = driver.find_element(By.ID, element_id)
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(text)


def _plan(driver) -> dict[str, str]:
    return {k: "".join(dom(driver, f"#plan [data-plan={k}]")) for k in ("strategy", "world_size", "memory", "batch")}


def _wide(driver) -> list:
    """What sticks out past the window's right edge (for a failure's message)."""
    return driver.execute_script(
        "const w=window.innerWidth;return [w,document.documentElement.scrollWidth,...[...document.querySelectorAll('body *')]"
        ".filter(e=>e.getBoundingClientRect().right>w+0.5&&!(e.parentElement&&e.parentElement.closest('.scroll'))).slice(0,12).map(e=>e.tagName+'#'+e.id+'.'+e.className+' '"
        "+Math.round(e.getBoundingClientRect().right)),...[...document.querySelectorAll('body, body *')]"
        ".filter(e=>e.scrollWidth>e.clientWidth+1&&getComputedStyle(e).overflowX==='visible').slice(0,8)"
        ".map(e=>'overflows: '+e.tagName+'#'+e.id+' '+e.scrollWidth+'>'+e.clientWidth)]"
    )


def _cli(*args: str, cwd: Path) -> str:
    """`scaletune ARGS` as a user types it, offline (forked from the worker's CLI zygote: the
    control's answer, not the service's)."""
    out = run_cli(list(args), cwd=cwd)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_from_an_uploaded_chat_file_and_the_form_to_a_pushed_compared_and_deleted_job(
    tiny_model_dir, tmp_path, monkeypatch
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    need(CHROMIUM and DRIVER, NO_BROWSER)
    # The operator maps its Hub token to every owner's jobs by reference (`--job-secret`).
    policy = dataclasses.replace(TEST_POLICY, job_secrets=("*:HF_TOKEN=TEAM_HF_TOKEN",))
    srv = Server(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs", policy=policy)
    token = create_token(srv.svc.Session, "submit")
    api = client(srv, token)
    shots = Path(os.environ.get("SCALETUNE_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    data_file = tmp_path / "chat-walk.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in _conversations(48)))
    driver = headless_chromium(tmp_path / "chromium-profile")
    driver.set_window_size(1280, 1100)
    try:
        driver.get(srv.url + "/login")
        driver.find_element(By.ID, "token").send_keys(token)
        driver.find_element(By.ID, "login").click()
        wait_for(lambda: dom(driver, "#no-jobs", visible=True), 30, "the empty state of the job list")

        # 0. The API docs render in the browser with the page's session (Swagger UI 5 reads the
        # OpenAPI 3.1 FastAPI writes; 4.15 answered "Unable to render this definition").
        driver.get(srv.url + "/docs")
        wait_for(lambda: len(dom(driver, ".opblock-summary-path")) > 10, 60, "the API's operations in /docs")
        title = dom(driver, ".swagger-ui .info .title")[0]
        assert title.startswith("scaletune serve") and "OAS 3.1" in title, title
        assert "/api/jobs" in dom(driver, ".opblock-summary-path", "data-path")
        assert "Unable to render" not in driver.page_source
        driver.get(srv.url + "/")
        wait_for(lambda: dom(driver, "#no-jobs", visible=True), 30, "the job list again")

        # 1. Bring data: the upload lands in the data area with every record.
        driver.find_element(By.ID, "data-file").send_keys(str(data_file))
        driver.find_element(By.ID, "data-upload").click()
        wait_for(lambda: any("chat-walk.jsonl" in t for t in dom(driver, "#data-files li")), 60, "the upload")
        listed = {f["name"]: f for f in api.get("/api/data").json()}
        assert listed["chat-walk.jsonl"]["records"] == 48 and listed["chat-walk.jsonl"]["format"] == "messages"

        # 2. The form alone, no YAML typed: a model folder, the uploaded file ("use this file" puts its
        # path and the format its keys say in the YAML), the batch, sequence length, steps, a sample prompt.
        def config() -> dict:
            return yaml.safe_load(_value(driver, "#config") or "{}") or {}

        _type(driver, "f-model", str(tiny_model_dir))
        wait_for(lambda: config().get("model", {}).get("name_or_path") == str(tiny_model_dir), 30, "the model")
        driver.find_element(By.ID, "data-use").click()
        area_path = listed["chat-walk.jsonl"]["path"]
        wait_for(lambda: config().get("data", {}).get("train", {}).get("path") == area_path, 30, "the file in the YAML")
        assert config()["data"]["train"]["format"] == "messages" and _value(driver, "#f-format") == "messages"
        # Typed one after the other without a pause: each field's value reaches the YAML (a shared
        # typing timer once dropped all but the last).
        for field, value in (
            ("f-micro-batch", "2"),
            ("f-global-batch", "8"),
            ("f-seq-len", "64"),
            ("f-steps", str(STEPS)),
        ):
            _type(driver, field, value)
        driver.find_element(By.ID, "f-prompts").send_keys(PROMPT)
        # Precision `auto`: float32 on this CPU (bfloat16, the schema's default, is about 1 s a step here).
        Select(driver.find_element(By.ID, "f-dtype")).select_by_value("auto")
        wait_for(lambda: config().get("model", {}).get("dtype") == "auto", 30, "the precision in the YAML")
        want_fields = {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": STEPS, "sample_prompts": [PROMPT]}
        wait_for(
            lambda: (
                {k: config().get("training", {}).get(k) for k in want_fields} == want_fields
                and config()["data"].get("max_seq_length") == 64
            ),
            30,
            "the fields in the YAML",
        )

        # 3. Preview as training renders it: records with trained spans, a histogram.
        driver.find_element(By.ID, "data-preview").click()
        wait_for(lambda: dom(driver, "#data-records .record mark.trained"), 90, "the preview's trained spans")
        assert dom(driver, "#data-histogram rect"), "no histogram bars"
        driver.save_screenshot(str(shots / "page-walk-data.png"))

        # 4. The form: the plan preview follows the fields (LoRA holds far less optimizer state).
        driver.find_element(By.ID, "preview").click()
        wait_for(lambda: _plan(driver)["strategy"] or dom(driver, "#problems li"), 90, "the first plan preview")
        assert not dom(driver, "#problems li"), dom(driver, "#problems li")
        full = _plan(driver)
        dry = api.post("/api/jobs", json={"config": _value(driver, "#config"), "dry_run": True}).json()["plan"]
        assert dry["strategy"] in full["strategy"], (dry["strategy"], full)
        Select(driver.find_element(By.ID, "f-method")).select_by_value("lora")
        wait_for(lambda: "lora:" in _value(driver, "#config"), 30, "LoRA in the YAML")
        wait_for(lambda: _plan(driver)["memory"] not in ("", full["memory"]), 90, "the plan preview changed")
        _type(driver, "f-lr", "0.002")
        wait_for(lambda: config()["training"].get("learning_rate") == 0.002, 30, "lr")
        driver.save_screenshot(str(shots / "page-walk-form.png"))

        # 5. Submit, watch the chart gain points, stop, resume, see it succeed.
        driver.find_element(By.ID, "submit").click()
        # The submit is checked by the service first (the config, the model folder, the data): on two
        # cores busy with another worker's runs it once took over 60 s.
        wait_for(lambda: "/jobs/" in driver.current_url, 180, "the job page")
        job_id = driver.current_url.rstrip("/").split("/")[-1]

        def points() -> int:
            counts = dom(driver, "#chart polyline.series", "data-points")
            return int(counts[0]) if counts else 0

        wait_for(lambda: points() >= 3, 240, "three points on the chart")
        driver.find_element(By.ID, "stop").click()
        wait_for(lambda: dom(driver, "#state") == ["stopped"], 120, "stopped")
        stopped_at = api.get(f"/api/jobs/{job_id}").json()["step"]
        assert 0 < stopped_at < STEPS
        driver.find_element(By.ID, "resume").click()
        wait_for(lambda: api.get(f"/api/jobs/{job_id}").json()["state"] != "stopped", 60, "the resume taken")
        ended = wait_state(api, job_id, {"succeeded", "failed", "cancelled", "stopped"}, timeout=400)
        assert ended["state"] == "succeeded", (ended, api.get(f"/api/jobs/{job_id}/logs").text[-3000:])
        wait_for(lambda: dom(driver, "#state") == ["succeeded"], 30, "succeeded on the page")
        metrics = [m for m in api.get(f"/api/jobs/{job_id}/metrics").json() if m.get("loss") is not None]
        assert [m["step"] for m in metrics][-1] == STEPS
        driver.refresh()
        wait_for(lambda: points() == len({m["step"] for m in metrics}), 60, "every step on the chart")
        assert "".join(dom(driver, "#flag", visible=True)) == ""  # a finite, falling loss is not flagged
        driver.save_screenshot(str(shots / "page-walk-job.png"))
        run_dir = Path(api.get(f"/api/jobs/{job_id}").json()["run_dir"])

        # 6. Talk to the result: the streamed answer equals `scaletune generate` (greedy) on final/.
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
        out = _cli("generate", str(run_dir), "--prompts", str(prompts), "--max-new-tokens", "24", cwd=srv.home)
        want = json.loads(out.splitlines()[-1])
        _type(driver, "chat-max", "24")
        _type(driver, "chat-input", PROMPT)
        driver.find_element(By.ID, "chat-send").click()
        done = "#chat-log .msg.assistant[data-state=done], #chat-log .msg.assistant[data-state=failed]"
        wait_for(lambda: dom(driver, done), 180, "the streamed answer")
        assert not dom(driver, "#chat-problems li"), dom(driver, "#chat-problems li")
        answer = dom(driver, "#chat-log .msg.assistant[data-state=done] .text")[-1]
        assert answer.strip() == want["response"].strip()
        driver.save_screenshot(str(shots / "page-walk-chat.png"))

        # 7. Evaluate on the uploaded file, picked from the data area (a small task); compare with the CLI's loss.
        wait_for(lambda: "chat-walk.jsonl" in dom(driver, "#eval-data option", prop="value"), 30, "the data list")
        Select(driver.find_element(By.ID, "eval-data")).select_by_value("chat-walk.jsonl")
        driver.find_element(By.ID, "eval-run").click()
        wait_for(lambda: dom(driver, "#tasks [data-state=succeeded]"), 300, "the evaluation task")
        want_loss = json.loads(_cli("eval", str(run_dir), "--data", area_path, "--json", cwd=srv.home))["loss"]
        cells = wait_for(lambda: dom(driver, "#evaluation tbody tr td"), 60, "the evaluation row")
        assert f"{want_loss:.4f}" in cells, (want_loss, cells)

        # 8. Ship it: export (LoRA merged) as a task, pushed to the Hub, then download the archive.
        Select(driver.find_element(By.ID, "export-dtype")).select_by_visible_text("float32")
        if not driver.find_element(By.ID, "export-merge").is_selected():
            driver.find_element(By.ID, "export-merge").click()
        _type(driver, "export-push", "team/walk-model")
        # The service has no token under the mapped name yet: refused before any task, saying how.
        driver.find_element(By.ID, "export-run").click()
        said = wait_for(lambda: dom(driver, "#task-problems li"), 30, "the push refused")
        assert any("no Hugging Face token for this job's owner" in t and "--job-secret" in t for t in said), said
        assert len(api.get(f"/api/jobs/{job_id}/tasks").json()) == 1  # the evaluation only
        hub = LoopbackHub()
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setenv("TEAM_HF_TOKEN", HUB_TOKEN)
        driver.find_element(By.ID, "export-run").click()

        def export_ended() -> dict | None:
            tasks = [t for t in api.get(f"/api/jobs/{job_id}/tasks").json() if t["kind"] == "export"]
            return tasks[0] if tasks and tasks[0]["state"] != "running" else None

        export = wait_for(export_ended, 300, "the export task")
        assert export["state"] == "succeeded", export
        wait_for(lambda: len(dom(driver, "#tasks [data-state=succeeded]")) >= 2, 30, "the export on the page")
        # The page's export is checked in a fresh process (export --verify) and says so.
        assert any("verified: reloaded in a fresh process" in t for t in dom(driver, "#tasks [data-state=succeeded]"))
        # Pushed: the Hub got the exported folder, file for file, with the mapped token; the page links the commit.
        folder = run_dir / export["result"]["path"]
        sent = {name: hashlib.sha256(data).hexdigest() for name, data in hub.repos["team/walk-model"][0].items()}
        assert sent == {
            str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in folder.rglob("*")
            if f.is_file()
        }
        # Every upload request carried the mapped token (huggingface_hub also reads an agent registry, unauthenticated).
        sent_auth = {auth for method, _, auth in hub.seen if method == "POST"}
        assert hub.private == {"team/walk-model": True} and sent_auth == {f"Bearer {HUB_TOKEN}"}, hub.seen
        assert dom(driver, "#tasks a.pushed", prop="href") == [export["result"]["commit_url"]]
        assert export["result"]["commit_url"].startswith(f"{hub.url}/team/walk-model/commit/")
        hub.close()
        # The token was never written: no file of the service (database, job folders, logs, task output) holds it.
        holding = [f for f in tmp_path.rglob("*") if f.is_file() and HUB_TOKEN.encode() in f.read_bytes()]
        assert not holding, holding
        links = wait_for(
            lambda: dom(driver, "#downloads a.archive[data-path^=exports]", prop="href"), 60, "the export's archive"
        )
        # The browser downloads it with its session; its bytes (SHA-256) equal the API's answer.
        seen = driver.execute_async_script(
            "const done=arguments[arguments.length-1];fetch(arguments[0]).then(r=>r.arrayBuffer())"
            ".then(b=>crypto.subtle.digest('SHA-256',b).then(h=>done([b.byteLength,"
            "Array.from(new Uint8Array(h)).map(x=>x.toString(16).padStart(2,'0')).join('')])))"
            ".catch(e=>done(String(e)))",
            links[-1],
        )
        tar_bytes = api.get(links[-1]).content
        assert seen == [len(tar_bytes), hashlib.sha256(tar_bytes).hexdigest()], seen
        with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
            names = {Path(m.name).name for m in tar.getmembers() if m.isfile()}
        assert {"config.json", "model.safetensors"} <= names, names
        driver.save_screenshot(str(shots / "page-walk-ship.png"))

        # 9. Another setting, compared: the job cloned with a higher learning rate and fewer steps
        # (the clone's overrides field), run, then both ticked in the job list and compared.
        _type(driver, "clone-overrides", f"training.learning_rate=0.02 training.max_steps={CLONE_STEPS}")
        driver.find_element(By.ID, "clone").click()
        wait_for(lambda: f"/jobs/{job_id}" not in driver.current_url, 60, "the clone's page")
        clone_id = driver.current_url.rstrip("/").split("/")[-1]
        cloned = wait_state(api, clone_id, {"succeeded", "failed", "cancelled"}, timeout=300)
        assert cloned["state"] == "succeeded", api.get(f"/api/jobs/{clone_id}/logs").text[-3000:]
        driver.get(srv.url + "/")
        wait_for(lambda: {job_id, clone_id} <= set(dom(driver, "#jobs input.compare", "value")), 30, "both jobs listed")
        for jid in (job_id, clone_id):
            driver.find_element(By.CSS_SELECTOR, f'#jobs input.compare[value="{jid}"]').click()
        driver.find_element(By.ID, "compare-selected").click()
        wait_for(lambda: len(dom(driver, "#summary tbody tr")) == 2, 60, "the summary table")
        for jid in (job_id, clone_id):
            summary = api.get(f"/api/jobs/{jid}/metrics/summary").json()
            row = f'#summary tbody tr[data-job="{jid}"]'
            # A row shows "…" until its summary has come (each row's own request).
            wait_for(lambda row=row: dom(driver, f"{row} td[data-key=steps]") != ["…"], 30, "the row's summary")
            assert dom(driver, f"{row} td[data-key=steps]") == [str(summary["steps"])], (jid, summary)
        assert [
            dom(driver, f'#summary tbody tr[data-job="{j}"] td[data-key=steps]')[0] for j in (job_id, clone_id)
        ] == [
            str(STEPS),
            str(CLONE_STEPS),
        ]
        driver.save_screenshot(str(shots / "page-walk-compare.png"))

        # 10. Delete the clone from its page (asked first): gone from the list, the API and the disk.
        driver.get(f"{srv.url}/jobs/{clone_id}")
        wait_for(lambda: dom(driver, "#delete", visible=True), 30, "the Delete button")
        driver.find_element(By.ID, "delete").click()
        wait_for(lambda: dom(driver, "#delete-confirm", visible=True), 10, "the question")
        driver.find_element(By.ID, "delete-yes").click()
        wait_for(lambda: driver.current_url == srv.url + "/", 30, "the job list")
        wait_for(lambda: clone_id not in dom(driver, "#jobs tbody tr", "data-job"), 30, "the clone gone from the list")
        assert api.get(f"/api/jobs/{clone_id}").status_code == 404 and not Path(cloned["run_dir"]).exists()
        assert api.get(f"/api/jobs/{job_id}").json()["state"] == "succeeded"
        driver.get(f"{srv.url}/jobs/{job_id}")

        # 11. A phone's width: the job page reflows (no sideways scroll of the page).
        driver.set_window_size(390, 844)
        driver.refresh()
        wait_for(lambda: points() > 0, 60, "the chart at phone width")
        assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth"), _wide(driver)
        driver.save_screenshot(str(shots / "page-walk-phone-job.png"))
        driver.get(srv.url + "/")
        wait_for(lambda: dom(driver, "#jobs input.compare"), 30, "the job list")
        assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        driver.save_screenshot(str(shots / "page-walk-phone-jobs.png"))
    finally:
        driver.quit()
        srv.cancel_all()
        srv.stop()


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
