"""Online RL through `scaletune serve` and the page (issue 36: "the page charts reward beside
loss"): a GRPO config pasted into the page's form is checked by the service (its reward functions
are built-ins, which the default policy allows), submitted, run as a job, and its page draws the
mean reward of every training step and of the evaluation beside the loss, and links the run's
rollouts.jsonl. The controls are the run's own files: the values drawn and the metrics API's
against metrics.jsonl (the evaluation before training, step 0, included: the API left it out
before), the download against rollouts.jsonl's bytes.

Data: 8 training and 4 held-out prompts from the real Alpaca records (the instruction, and the
first word of the record's output as `answer`)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.helpers import ALPACA_5000, make_config, wait_for
from tests.serve.serve_helpers import CHROMIUM, DRIVER, NO_BROWSER, client, dom, need, wait_state

STEPS = 3


def _grpo_config(model: Path, folder: Path) -> dict:
    records = [r for r in json.loads(ALPACA_5000.read_text()) if not r["input"] and len(r["instruction"]) < 80][:12]
    files = {}
    for name, part in (("train", records[:8]), ("eval", records[8:])):
        files[name] = folder / f"prompts-{name}.jsonl"
        lines = [json.dumps({"prompt": r["instruction"], "answer": r["output"].split()[0]}) for r in part]
        files[name].write_text("\n".join(lines) + "\n")
    return make_config(
        model,
        folder / "run",
        data={
            "train": {"path": str(files["train"]), "format": "prompt"},
            "eval": {"path": str(files["eval"]), "format": "prompt"},
            "max_seq_length": 64,
        },
        training={
            "objective": "grpo",
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "max_steps": STEPS,
            "eval_every": STEPS,
            "eval_on_start": True,
            "save_every": 0,
            "log_every": 1,
            "learning_rate": 1e-3,
            "rl": {
                "num_generations": 4,
                "max_new_tokens": 6,
                "rewards": [
                    {"function": "scaletune.rewards:exact_answer"},
                    {"function": "scaletune.rewards:length_penalty", "weight": 0.5, "kwargs": {"max_chars": 12}},
                ],
            },
        },
    )


def _series(driver, label: str) -> list[tuple[float, float]]:
    """(step, value) of the reward chart's series `label`, as the page drew it."""
    values = dom(driver, f"#reward-chart polyline.series[data-label={label}]", "data-values")
    return [(float(a), float(b)) for a, b in (p.split(":") for p in values[0].split())] if values else []


def test_a_grpo_job_from_the_form_charts_its_reward_beside_the_loss(server, page, tiny_model_dir, module_tmp_path):
    from selenium.webdriver.common.by import By

    need(CHROMIUM and DRIVER, NO_BROWSER)
    driver = page
    driver.get(server.url + "/")
    wait_for(lambda: driver.find_elements(By.ID, "config"), 30, "the submit form")
    cfg = yaml.safe_dump(_grpo_config(tiny_model_dir, module_tmp_path))
    driver.execute_script(
        "const t=document.getElementById('config');t.value=arguments[0];t.dispatchEvent(new Event('input'))", cfg
    )
    driver.find_element(By.ID, "submit").click()
    wait_for(lambda: "/jobs/" in driver.current_url, 180, "the job page")
    job_id = driver.current_url.rstrip("/").split("/")[-1]
    api = client(server, server.read)
    job = wait_state(api, job_id, {"succeeded", "failed", "cancelled"}, timeout=400)
    assert job["state"] == "succeeded", api.get(f"/api/jobs/{job_id}/logs").text[-3000:]

    lines = api.get(f"/api/jobs/{job_id}/metrics").json()
    written = [json.loads(x) for x in (Path(job["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert lines == written  # every line as the run wrote it, the evaluation before training first
    train = [(m["step"], m["reward"]) for m in lines if "reward" in m and "eval_loss" not in m]
    evals = [(m["step"], m["eval_reward"]) for m in lines if "eval_reward" in m]
    assert [s for s, _ in train] == list(range(1, STEPS + 1)) and [s for s, _ in evals] == [0, STEPS]
    driver.refresh()
    wait_for(lambda: dom(driver, "#rewards", visible=True), 60, "the reward chart")
    assert dom(driver, "#rewards-title") == ["Mean reward (online RL)"]
    drawn, drawn_eval = _series(driver, "reward"), _series(driver, "eval_reward")
    assert [s for s, _ in drawn] == [s for s, _ in train] and [s for s, _ in drawn_eval] == [s for s, _ in evals]
    for got, want in zip(drawn + drawn_eval, train + evals):
        assert abs(got[1] - want[1]) <= 1e-9 * max(1.0, abs(want[1])), (got, want)
    assert dom(driver, "#chart polyline.series", "data-label")[0] == "loss"  # the loss chart above it, unchanged
    # The run's completions, linked from the page and served as they are on disk.
    link = wait_for(lambda: dom(driver, "#rollouts a", prop="href", visible=True), 30, "the rollouts link")[0]
    served = client(server, server.submit).get(link)
    assert served.status_code == 200
    assert served.content == (Path(job["run_dir"]) / "rollouts.jsonl").read_bytes()
    rollouts = [json.loads(x) for x in served.text.splitlines()]
    assert {r["step"] for r in rollouts if r["split"] == "train"} == set(range(1, STEPS + 1))
