"""The watch part of the page (issue 23) in a real headless Chromium against a real service
running real tiny jobs: the jobs list (empty state, live rows, compare checkboxes), the chart
(axes and ticks, eval loss on the same axes, smoothing, hover), the progress bar, tokens/s,
memory per rank, start time and duration, the final eval loss, the divergence flag of a run
whose loss went NaN, the compare page's config differences, and the layout at a phone's width.

Every number the page shows is checked against its control: the metrics API's lines (the run's
metrics.jsonl), the overrides the jobs were given. One service, one logged-in browser, three
real jobs (two that succeed, one that diverges) for the whole module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.helpers import make_config, wait_for
from tests.serve.serve_helpers import client, dom, wait_state

JOB = {"max_steps": 6, "save_every": 0, "micro_batch_size": 8, "eval_every": 2, "log_every": 1}
#: The overrides of the two compared jobs; the keys they differ in are the diff's control.
OVERRIDES_A = ["training.learning_rate=0.001"]
OVERRIDES_B = ["training.learning_rate=0.002", "seed=7", "training.warmup_steps=1"]
CHANGED = {"training.learning_rate", "seed", "training.warmup_steps"}
PHONE = {"width": 390, "height": 844, "deviceScaleFactor": 3, "mobile": True}


def shots(tmp_path: Path) -> Path:
    return Path(os.environ.get("SCALETUNE_SCREENSHOT_DIR") or tmp_path)


def submit(server, cfg: dict, overrides: list[str]) -> str:
    r = client(server, server.submit).post("/api/jobs", json={"config": yaml.safe_dump(cfg), "overrides": overrides})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def api_lines(server, job_id: str) -> tuple[list[dict], list[dict]]:
    """(train lines, eval lines) from the metrics API: the control of what the page shows."""
    lines = client(server, server.read).get(f"/api/jobs/{job_id}/metrics").json()
    return [r for r in lines if "eval_loss" not in r], [r for r in lines if "eval_loss" in r]


@pytest.fixture(scope="module")
def jobs(server, module_tmp_path, tiny_model_dir):
    """Two real jobs of one config, differing by their overrides (A then B, one at a time)."""
    cfg = make_config(tiny_model_dir, module_tmp_path / "watch-run", training=JOB, data={"eval_fraction": 0.25})
    # Each job has its own run directory (the service refuses a shared one): output_dir, which
    # the compare page leaves out, as the service assigns it per job.
    other = f"output_dir={module_tmp_path / 'watch-run-b'}"
    ids = {"a": submit(server, cfg, OVERRIDES_A), "b": submit(server, cfg, [*OVERRIDES_B, other])}
    c = client(server, server.read)
    for job_id in ids.values():
        job = wait_state(c, job_id, {"succeeded", "failed", "cancelled"}, timeout=300)
        assert job["state"] == "succeeded", c.get(f"/api/jobs/{job_id}/logs").text[-3000:]
    return ids


def chart_state(driver) -> dict:
    """What #chart draws, read in one script call (it is rebuilt on every event)."""
    return driver.execute_script(
        """const svg = document.getElementById('chart'), a = (n, k) => n.getAttribute(k);
        const pairs = s => (s || '').split(' ').filter(x => x).map(v => v.split(':').map(Number));
        return {width: svg.clientWidth, height: svg.clientHeight,
          raw: Array.from(svg.querySelectorAll('polyline.series')).map(p => ({label: a(p, 'data-label'),
            values: pairs(a(p, 'data-values')), points: a(p, 'points').split(' ').map(q => q.split(',').map(Number))})),
          smoothed: Array.from(svg.querySelectorAll('path.smoothed')).map(p => ({label: a(p, 'data-label'), values: pairs(a(p, 'data-values'))})),
          dots: Array.from(svg.querySelectorAll('circle')).map(c => ({label: a(c, 'data-label'), cy: +a(c, 'cy'), cx: +a(c, 'cx')})),
          xticks: Array.from(svg.querySelectorAll('text.tick.x')).map(t => [+a(t, 'data-value'), t.textContent, +a(t, 'x')]),
          yticks: Array.from(svg.querySelectorAll('text.tick.y')).map(t => [+a(t, 'data-value'), t.textContent, +a(t, 'y')]),
          axis: Array.from(svg.querySelectorAll('text.axis-label')).map(t => t.textContent)};"""
    )


def ema(values: list[float], w: float) -> list[float]:
    """The page's smoothing (TensorBoard's debiased EMA), written again here as the control."""
    out, s = [], 0.0
    for n, v in enumerate(values, 1):
        s = w * s + (1 - w) * v
        out.append(s / (1 - w**n) if w > 0 else v)
    return out


def test_empty_state_then_a_live_row(server, page, tiny_model_dir, tmp_path):  # noqa: F811
    """A service without jobs says so; a job submitted elsewhere (the API) appears in the open
    page's list without a reload, and the empty state goes."""
    page.get(server.url + "/")
    wait_for(lambda: dom(page, "#no-jobs", visible=True), 10, "the empty state")
    assert dom(page, "#no-jobs")[0].startswith("no jobs yet") and dom(page, "#jobs tbody tr") == []
    page.execute_script("window.notReloaded = true")
    cfg = make_config(tiny_model_dir, tmp_path / "live", training={"max_steps": 1, "save_every": 0})
    job_id = submit(server, cfg, [])
    wait_for(lambda: dom(page, "#jobs input.compare", "value") == [job_id], 15, "the new row")
    assert page.execute_script("return window.notReloaded === true")  # the list, not the page, was read again
    assert dom(page, "#no-jobs", visible=True) == []
    wait_state(client(server, server.read), job_id, {"succeeded", "failed"}, timeout=300)


def test_chart_axes_eval_smoothing_hover(server, page, jobs, tmp_path):  # noqa: F811
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    train, ev = api_lines(server, jobs["a"])
    losses, evals = [(r["step"], r["loss"]) for r in train], [(r["step"], r["eval_loss"]) for r in ev]
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6] and [s for s, _ in evals] == [2, 4, 6], (losses, evals)
    page.get(f"{server.url}/jobs/{jobs['a']}")
    wait_for(lambda: [len(s["values"]) for s in chart_state(page)["raw"]] == [6, 3], 30, "both loss series")
    page.execute_script(
        "const s = document.getElementById('smoothing'); s.value = '0'; s.dispatchEvent(new Event('input'))"
    )
    st = chart_state(page)
    raw, eval_line = st["raw"]
    assert raw["label"] == "loss" and [tuple(v) for v in raw["values"]] == losses
    assert eval_line["label"] == "eval_loss" and [tuple(v) for v in eval_line["values"]] == evals
    # Ticks: numbers, labelled, spanning the data's range to within one tick step on both axes.
    for ticks, lo, hi in (
        (st["xticks"], 1, 6),
        (st["yticks"], min(v for _, v in losses + evals), max(v for _, v in losses + evals)),
    ):
        values = [t[0] for t in ticks]
        assert len(values) >= 2 and all(t[1] for t in ticks), ticks
        step = values[1] - values[0]
        assert lo - 1e-9 <= values[0] <= lo + step and hi - step <= values[-1] <= hi + 1e-9, (ticks, lo, hi)
    assert st["axis"] == ["step", "loss"], st["axis"]
    # Eval on the same axes: the y mapping read off the train line (two of its points) puts each eval
    # dot exactly where it is drawn, and a tick's position agrees with it too.
    (s1, y1), (s2, y2) = raw["points"][0], raw["points"][-1]
    (_, v1), (_, v2) = losses[0], losses[-1]
    to_y = lambda v: y1 + (v - v1) * (y2 - y1) / (v2 - v1)  # noqa: E731
    to_x = lambda s: s1 + (s - 1) * (s2 - s1) / 5  # noqa: E731
    assert [d["label"] for d in st["dots"]] == ["eval_loss"] * 3
    for dot, (step_, value) in zip(st["dots"], evals):
        assert abs(dot["cy"] - to_y(value)) < 0.01 and abs(dot["cx"] - to_x(step_)) < 0.01, (dot, step_, value)
    for value, _, y in st["yticks"]:
        assert abs(y - 3 - to_y(value)) < 0.01, (value, y)  # the label sits 3 px below its line's y
    # Smoothing: 0 draws the raw values; 0.9 the EMA of the API's losses; the raw line never moves.
    assert [v for _, v in st["smoothed"][0]["values"]] == pytest.approx([v for _, v in losses], rel=1e-12)
    page.execute_script(
        "const s = document.getElementById('smoothing'); s.value = '0.9'; s.dispatchEvent(new Event('input'))"
    )
    after = chart_state(page)
    smooth = [v for _, v in after["smoothed"][0]["values"]]
    assert smooth == pytest.approx(ema([v for _, v in losses], 0.9), rel=1e-9)
    assert smooth != pytest.approx([v for _, v in losses], rel=1e-6)
    assert after["raw"][0]["values"] == raw["values"] and after["raw"][0]["points"] == raw["points"]
    assert dom(page, "#smoothing-value") == ["0.9"]
    # Hover: the pointer over step 4's x shows step 4 and the values the API has there.
    svg = page.find_element(By.ID, "chart")
    x4 = to_x(4)
    ActionChains(page).move_to_element_with_offset(svg, int(round(x4 - after["width"] / 2)), 0).perform()
    got = wait_for(lambda: dom(page, "#chart .hover-text tspan[data-value]", "data-value"), 5, "the hover values")
    assert dom(page, "#chart .hover-step", "data-step") == ["4"]
    assert dom(page, "#chart .hover-text tspan[data-value]", "data-label") == ["loss", "eval_loss"]
    assert [float(v) for v in got] == [dict(losses)[4], dict(evals)[4]]
    page.save_screenshot(str(shots(tmp_path) / "page-watch-job.png"))


def half_up(x: float, places: int) -> str:
    """`x` with `places` decimals as the page's JavaScript writes it (`toFixed`, `Math.round`): the
    exact binary value, a tie rounded up. Python's format rounds a tie to even: 747.25 MiB (an RSS
    of a multiple of 256 KiB) is 747.3 on the page and 747.2 in an f-string (CI at c6ba6b1)."""
    from decimal import ROUND_HALF_UP, Decimal

    return str(Decimal(x).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP))


def test_progress_and_stats(server, page, jobs):  # noqa: F811
    train, ev = api_lines(server, jobs["a"])
    last = train[-1]
    assert last["total_steps"] == 6 and last["memory_of"] == "process rss" and len(last["memory_bytes"]) == 1
    page.get(f"{server.url}/jobs/{jobs['a']}")
    wait_for(lambda: dom(page, "#progress", prop="value") == [6], 30, "the full progress bar")
    assert dom(page, "#progress", prop="max") == [6] and dom(page, "#eta") == ["done"]
    stat = lambda n, attr=None: dom(page, f"#stats [data-stat={n}]", attr)[0]  # noqa: E731
    assert float(stat("tokens_per_s", "data-value")) == last["tokens_per_s"]
    assert stat("tokens_per_s") == half_up(last["tokens_per_s"], 0)
    assert yaml.safe_load(stat("memory", "data-value")) == last["memory_bytes"]
    assert stat("memory") == f"rank 0 {half_up(last['memory_bytes'][0] / 2**20, 1)} MiB (process rss)"
    assert float(stat("final_eval_loss", "data-value")) == ev[-1]["eval_loss"]
    assert stat("final_eval_loss") == f"{ev[-1]['eval_loss']:.4f}"
    assert stat("started", "data-value") and stat("started")[:4].isdigit(), stat("started")
    assert stat("duration", "data-ended") and stat("duration").endswith(" s"), stat("duration")
    assert dom(page, "#flag", visible=True) == [] and "flagged" not in dom(page, "#state", "class")[0]


def test_nan_loss_is_flagged(server, page, tiny_model_dir, tmp_path):  # noqa: F811
    """An absurd learning rate without clipping drives the tiny model's loss to inf/NaN (as in
    tests/e2e/test_train_cli.py): the job fails as diverged, the API still answers (strict JSON),
    and the page flags it; the healthy job's page (test_progress_and_stats) shows no flag."""
    cfg = make_config(
        tiny_model_dir,
        tmp_path / "nan",
        training={
            "learning_rate": 1.0e30,
            "max_grad_norm": None,
            "warmup_steps": 0,
            "lr_scheduler": "constant",
            "save_every": 0,
            "max_steps": 8,
        },
    )
    job_id = submit(server, cfg, [])
    c = client(server, server.read)
    job = wait_state(c, job_id, {"succeeded", "failed", "cancelled"}, timeout=300)
    assert job["state"] == "failed" and job["reason"] == "diverged", job
    train, _ = api_lines(server, job_id)
    bad = [r for r in train if r["loss"] in ("NaN", "Infinity", "-Infinity")]
    assert bad and job["flag"] == f"non-finite loss ({bad[0]['loss']}) at step {bad[0]['step']}", (job, train)
    assert c.get("/api/jobs").status_code == 200
    page.get(f"{server.url}/jobs/{job_id}")
    text = wait_for(lambda: dom(page, "#flag", visible=True), 30, "the flag")
    assert "non-finite loss" in text[0] and f"step {bad[0]['step']}" in text[0]
    assert "flagged" in dom(page, "#state", "class")[0]
    # The non-finite step is marked on the chart, not drawn as a point.
    wait_for(lambda: dom(page, "#chart line.nonfinite", "data-step") == [str(bad[0]["step"])], 30, "the NaN marker")
    page.get(server.url + "/")
    chip = wait_for(lambda: dom(page, f"#jobs tr[data-job='{job_id}'] .chip", "class"), 15, "the row")
    assert "flagged" in chip[0]


def test_compare_lists_the_changed_keys(server, page, jobs, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By

    page.get(server.url + "/")
    for job_id in (jobs["a"], jobs["b"]):
        css = f"#jobs input.compare[value='{job_id}']"
        wait_for(lambda css=css: page.find_elements(By.CSS_SELECTOR, css), 15, "the rows")
        page.find_element(By.CSS_SELECTOR, css).click()
    page.find_element(By.ID, "compare-selected").click()
    wait_for(lambda: "/compare?ids=" in page.current_url, 15, "the compare page")
    order = page.current_url.split("/compare?ids=")[1].split(",")  # the list's order: newest first
    assert order == [jobs["b"], jobs["a"]], page.current_url
    assert set(dom(page, "#diff tbody tr", "data-key")) == CHANGED
    row = {r.split("\t")[0]: r.split("\t")[1:] for r in dom(page, "#diff tbody tr")}
    assert row["training.learning_rate"] == ["0.002", "0.001"] and row["seed"] == ["7", "1234"], row
    assert row["training.warmup_steps"] == ["1", "2"], row
    wait_for(lambda: len(dom(page, "#chart polyline.series")) == 2, 15, "both curves")
    assert dom(page, "#chart polyline.series", "data-label") == order
    assert [t.split()[0] for t in dom(page, "#legend li")] == order
    page.save_screenshot(str(shots(tmp_path) / "page-watch-compare.png"))
    # The older two-field link goes on to the same page.
    page.get(f"{server.url}/compare?a={jobs['a']}&b={jobs['b']}")
    assert page.current_url.endswith(f"/compare?ids={jobs['a']}%2C{jobs['b']}") or page.current_url.endswith(
        f"/compare?ids={jobs['a']},{jobs['b']}"
    )
    assert set(dom(page, "#diff tbody tr", "data-key")) == CHANGED


def test_phone_width(server, page, jobs, tmp_path):  # noqa: F811
    """At a phone's 390 px (mobile emulation: without the viewport meta it would lay out at 980),
    no page scrolls sideways; the jobs table, wider than the phone, scrolls in its own box."""
    page.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", PHONE)
    try:
        for path, name in (
            ("/", "jobs"),
            (f"/jobs/{jobs['a']}", "job"),
            (f"/compare?ids={jobs['a']},{jobs['b']}", "compare"),
        ):
            page.get(server.url + path)
            wait_for(lambda: page.execute_script("return document.readyState") == "complete", 10, "the page")
            if name != "jobs":
                wait_for(lambda: dom(page, "#chart polyline.series"), 30, "the chart")
            inner, scroll, svg = page.execute_script(
                "return [innerWidth, document.documentElement.scrollWidth, document.getElementById('chart')?.clientWidth]"
            )
            assert inner == 390 and scroll <= inner, (name, inner, scroll)
            if svg is not None:
                assert 300 < svg <= 390, (name, svg)  # drawn at the phone's width, not at 700 px
            page.save_screenshot(str(shots(tmp_path) / f"page-watch-phone-{name}.png"))
        page.get(server.url + "/")
        box = wait_for(
            lambda: page.execute_script(
                "const b = document.querySelector('#jobs').parentElement; return b.rows ? null : [b.scrollWidth, b.clientWidth]"
            ),
            10,
            "the table's box",
        )
        assert box[0] > box[1], box  # the control: the table is wider than the phone, and contained
    finally:
        page.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


@pytest.mark.parametrize(
    ("losses", "flagged"),
    [
        ([2.0, 1.6, 1.3, 1.1, 1.0, 0.9], False),  # learning
        ([2.0, 2.1, 1.9, 2.05, 1.95, 2.08], False),  # flat and noisy: not above 1.1x the first loss
        ([2.0, 1.5, 1.0, 0.5, 0.9, 0.95], False),  # a rebound from 0.5, still below where it began
        ([2.0, 1.2, 1.0, 2.6, 3.0, 3.4], True),  # ended above the first loss and far above the best
    ],
)
def test_finite_divergence_rule(server, tmp_path, losses, flagged):
    """The rule of a run whose loss stays finite (records.loss_flag, docs/serve.md) on the record
    the service keeps, through the same `add_metric` a run's lines go through; the flag reaches
    the API's job summary."""
    from scaletune.serve.jobs.db import Job
    from scaletune.serve.jobs.records import add_metric
    from tests.serve.serve_helpers import plant_job

    job_id = plant_job(server.svc, tmp_path / "run", state="running")
    with server.svc.Session() as s:
        job = s.get(Job, job_id)
        for step, loss in enumerate(losses, 1):
            assert add_metric(s, job, {"step": step, "loss": loss})
            if step < 4:
                assert job.flag is None  # fewer than 4 lines: no verdict yet
        s.commit()
    flag = client(server, server.read).get(f"/api/jobs/{job_id}").json()["flag"]
    assert (flag is not None) == flagged, (losses, flag)
    if flagged:
        assert flag.startswith("diverged: the last 3 losses average 3")
