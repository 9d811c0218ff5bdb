"""The job page's reward-accuracy chart (issue 24): a preference run's `reward_accuracy` and
`eval_reward_accuracy` drawn on a second chart with a fixed 0..1 axis, in a real headless
Chromium, compared with the run's own metrics.jsonl; an SFT job's page (the control) shows no
such chart. Both jobs run for real through the service."""

from __future__ import annotations

import httpx
import yaml

from tests.helpers import make_config, metrics, wait_for
from tests.serve.conftest import client, plant_job, wait_state
from tests.serve.test_page_actions import page  # noqa: F401 - the logged-in Chromium fixture

JOB = {"max_steps": 4, "save_every": 0, "micro_batch_size": 8, "eval_every": 2}
REWARD_KEYS = ("reward_accuracy", "eval_reward_accuracy")
HEIGHT, PAD = 180, 30  # #reward-chart's height and chart()'s padding (base.html)


def reward_chart(driver) -> dict:
    """What #rewards shows, read in one script call (the chart is rebuilt on every event)."""
    return driver.execute_script(
        """const box = document.getElementById('rewards'), svg = document.getElementById('reward-chart');
        return {shown: !box.hidden && box.getClientRects().length > 0, height: svg.clientHeight,
          series: Array.from(svg.querySelectorAll('polyline')).map(p => ({label: p.dataset.label,
            values: p.getAttribute('data-values'), points: p.getAttribute('points')})),
          dots: svg.querySelectorAll('circle').length,
          title: (svg.querySelector('text') || {}).textContent || ''};"""
    )


def expected(lines: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Per series, the (step, value) pairs as metrics.jsonl holds them: train lines for
    reward_accuracy, eval lines (they carry eval_loss) for eval_reward_accuracy."""
    train = [(r["step"], r["reward_accuracy"]) for r in lines if "reward_accuracy" in r and "eval_loss" not in r]
    ev = [(r["step"], r["eval_reward_accuracy"]) for r in lines if "eval_reward_accuracy" in r]
    return {k: v for k, v in (("reward_accuracy", train), ("eval_reward_accuracy", ev)) if v}


def assert_chart_shows(chart: dict, want: dict[str, list[tuple[int, float]]]) -> None:
    """The series, their values and where they are drawn: y on the fixed 0..1 axis."""
    assert chart["shown"] and chart["height"] == HEIGHT, chart
    got = {s["label"]: s for s in chart["series"]}
    assert set(got) == set(want), (chart, want)
    for label, pairs in want.items():
        values = [tuple(v.split(":")) for v in got[label]["values"].split(" ")]
        assert [(int(x), float(y)) for x, y in values] == pairs, (label, values, pairs)
        ys = [float(p.split(",")[1]) for p in got[label]["points"].split(" ")]
        drawn = [(HEIGHT - PAD - y) / (HEIGHT - 2 * PAD) for y in ys]  # back to 0..1
        assert all(abs(d - v) < 1e-6 for d, (_, v) in zip(drawn, pairs)), (label, drawn, pairs)
    assert chart["dots"] == len(want.get("eval_reward_accuracy", []))
    assert chart["title"].endswith("0.000 .. 1.000"), chart["title"]


def run_job(server, cfg: dict) -> str:
    c = client(server, server.submit)
    job_id = c.post("/api/jobs", json={"config": yaml.safe_dump(cfg)}).json()["id"]
    job = wait_state(c, job_id, {"succeeded", "failed", "cancelled"}, timeout=300)
    assert job["state"] == "succeeded", c.get(f"/api/jobs/{job_id}/logs").text[-3000:]
    return job_id


def test_reward_accuracy_chart(server, page, tiny_model_dir, tmp_path):  # noqa: F811
    # The control: a real SFT job's page has its loss chart and no reward chart.
    sft = make_config(tiny_model_dir, tmp_path / "sft", training=JOB, data={"eval_fraction": 0.25})
    sft_id = run_job(server, sft)
    sft_lines = metrics(tmp_path / "sft")
    assert any("eval_loss" in r for r in sft_lines) and not any(k in r for r in sft_lines for k in REWARD_KEYS)
    page.get(f"{server.url}/jobs/{sft_id}")
    wait_for(lambda: page.execute_script("return document.querySelectorAll('#chart polyline').length"), 30, "loss")
    chart = reward_chart(page)
    assert not chart["shown"] and chart["series"] == [], chart

    # The SFT run's own lines with the preference keys a DPO run adds (until a DPO job runs
    # here: see the report), reported the way a run reports them, to a job the page follows live.
    lines = [dict(r) for r in sft_lines]
    for i, r in enumerate(lines):
        key = "eval_reward_accuracy" if "eval_loss" in r else "reward_accuracy"
        r[key], r[key.replace("accuracy", "margin")] = [0.5, 0.625, 0.75, 1.0, 0.0, 0.875][i % 6], 0.1 * i
    token = "stj_preference_page"
    job_id = plant_job(server.svc, tmp_path / "dpo", state="running", token=token)
    page.get(f"{server.url}/jobs/{job_id}")
    want = expected(lines)
    assert set(want) == set(REWARD_KEYS), want
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as c:
        first = lines[:1]
        assert c.post(f"/api/jobs/{job_id}/report", json={"events": [{"kind": "metric", "data": first[0]}]}).json()
        wait_for(lambda: reward_chart(page)["shown"], 30, "the reward chart after the first line")
        assert_chart_shows(reward_chart(page), expected(first))
        events = [{"kind": "metric", "data": r} for r in lines[1:]]
        assert c.post(f"/api/jobs/{job_id}/report", json={"events": events}).json()["accepted"] == len(events)
    wait_for(lambda: len(reward_chart(page)["series"]) == 2, 30, "both reward series")
    assert_chart_shows(reward_chart(page), want)
