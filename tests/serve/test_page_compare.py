"""The compare page's metric choice and summary table (issue 39 item 6), and the page's polish of
item 11, in a real headless Chromium against a real service: the metrics a run logged offered in a
select (train loss by default, eval and reward keys too), the chart redrawn with the chosen metric
(eval keys on their own steps), the summary table per run (final train loss, best and final eval
loss, steps, tokens, elapsed, the chosen metric's final value; "—" for what a run never logged);
the chart's x axis for runs of one to four steps (whole steps only, no tick past the data); the
samples of a running job read again when its phase changes; tables of values at a phone's width
(the job page's evaluation, the summary); the link to /docs; Log out on the "signed in as" line.

No training: finished jobs are planted in the service's database with a metrics.jsonl written by
the test (the numbers every assertion is checked against), its lines stored through the same
`add_metric` a run's lines go through."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.serve.serve_helpers import client, dom, plant_job

PHONE = {"width": 390, "height": 844, "deviceScaleFactor": 3, "mobile": True}
BASE = {"lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 900.0}

#: A preference run (DPO): three train steps, eval lines at steps 2 and 3.
PREFERENCE = [
    {"step": 1, "stage": "main", "loss": 2.0, "reward_accuracy": 0.5, "reward_margin": 0.1, "tokens": 100,
     "elapsed_s": 1.0, **BASE},
    {"step": 2, "stage": "main", "loss": 1.7, "reward_accuracy": 0.75, "reward_margin": 0.2, "tokens": 110,
     "elapsed_s": 2.0, **BASE},
    {"step": 2, "stage": "main", "eval_loss": 1.8, "eval_reward_accuracy": 0.5, "elapsed_s": 2.5},
    {"step": 3, "stage": "main", "loss": 1.4, "reward_accuracy": 1.0, "reward_margin": 0.3, "tokens": 120,
     "elapsed_s": 3.0, **BASE},
    {"step": 3, "stage": "main", "eval_loss": 1.9, "eval_reward_accuracy": 0.75, "elapsed_s": 3.5},
]  # fmt: skip
RL = {"reward_std": 0.2, "reward_exact_answer": 0.5, "completion_length": 12.0, "kl": 0.01, "clip_fraction": 0.0}
#: An online-RL run (GRPO) logging every 2nd step, resumed after step 2 (elapsed_s starts again); no eval.
ONLINE = [
    {"step": 2, "stage": "main", "loss": 0.3, "reward": 0.25, "zero_variance_groups": 1, "tokens": 200,
     "elapsed_s": 5.0, **BASE, **RL},
    {"step": 4, "stage": "main", "loss": 0.2, "reward": 0.5, "zero_variance_groups": 0, "tokens": 220,
     "elapsed_s": 1.5, **BASE, **RL},
]  # fmt: skip
#: A run of one logged step.
SHORT = [{"step": 1, "stage": "main", "loss": 3.0, "tokens": 50, "elapsed_s": 0.4, **BASE}]


def shots(tmp_path: Path) -> Path:
    return Path(os.environ.get("SCALETUNE_SCREENSHOT_DIR") or tmp_path)


def plant_finished(server, run_dir: Path, lines: list[dict]) -> str:
    """A succeeded job whose run directory holds `lines` as metrics.jsonl, read into the service's
    record line by line as its watcher reads a run's file."""
    from scaletune.serve.jobs.db import Job
    from scaletune.serve.jobs.records import add_metric

    job_id = plant_job(server.svc, run_dir, owner="submit")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    with server.svc.Session() as s:
        job = s.get(Job, job_id)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            assert add_metric(s, job, json.loads(line)), line
        s.commit()
    return job_id


@pytest.fixture(scope="module")
def runs(server, module_tmp_path):
    return {
        name: plant_finished(server, module_tmp_path / name, lines)
        for name, lines in (("preference", PREFERENCE), ("online", ONLINE), ("short", SHORT), ("none", []))
    }


def test_summary_api(server, runs):
    """GET /api/jobs/ID/metrics/summary: the control numbers of the page's table, from the planted lines."""
    c = client(server, server.read)
    got = {name: c.get(f"/api/jobs/{job_id}/metrics/summary").json() for name, job_id in runs.items()}
    pref, online, none = got["preference"], got["online"], got["none"]
    logged = ["loss", "lr", "grad_norm", "tokens_per_s", "reward_accuracy", "reward_margin"]
    assert pref["keys"] == sorted([*logged, "eval_loss", "eval_reward_accuracy"])
    assert pref["final"]["loss"] == 1.4 and pref["final"]["eval_loss"] == 1.9 and pref["best_eval_loss"] == 1.8
    assert (pref["steps"], pref["tokens"], pref["tokens_estimated"], pref["elapsed_s"]) == (3, 330, False, 3.5)
    assert {"reward", "reward_exact_answer", "zero_variance_groups", "kl"} <= set(online["keys"])
    assert "eval_loss" not in online["keys"] and online["best_eval_loss"] is None
    # Every 2nd step logged: 2 x 200 + 2 x 220, an estimate; a resume's elapsed_s adds to the first process's.
    assert (online["steps"], online["tokens"], online["tokens_estimated"], online["elapsed_s"]) == (4, 840, True, 6.5)
    assert online["final"]["zero_variance_groups"] == 0  # logged 0 is a value
    assert none == {
        "keys": [],
        "final": {},
        "best_eval_loss": None,
        "steps": None,
        "tokens": None,
        "tokens_estimated": False,
        "elapsed_s": None,
    }
    # The answer OpenAPI declares is the one given (every field, none more).
    declared = c.get("/openapi.json").json()["components"]["schemas"]["MetricsSummary"]["properties"]
    assert set(declared) == set(none), declared
    assert c.get("/api/jobs/nosuchjob/metrics/summary").status_code == 404
    assert client(server, None).get(f"/api/jobs/{runs['none']}/metrics/summary").status_code == 401


def chart(page) -> dict:
    """What #chart draws: its metric, each series' label and values, the dots, the x ticks and the
    plot's left and right edges (the x axis line)."""
    return page.execute_script(
        """const svg = document.getElementById('chart'), a = (n, k) => n.getAttribute(k);
        const pairs = s => (s || '').split(' ').filter(x => x).map(v => v.split(':').map(Number));
        const axis = svg.querySelector('g.axes line');
        return {metric: svg.dataset.metric,
          series: Array.from(svg.querySelectorAll('polyline.series')).map(p => [a(p, 'data-label'), pairs(a(p, 'data-values'))]),
          dots: Array.from(svg.querySelectorAll('circle')).map(c => a(c, 'data-label')),
          xticks: Array.from(svg.querySelectorAll('text.tick.x')).map(t => [+a(t, 'data-value'), t.textContent, +a(t, 'x')]),
          edges: axis ? [+a(axis, 'x1'), +a(axis, 'x2')] : null,
          points: Array.from(svg.querySelectorAll('polyline.series')).map(p => a(p, 'points'))};"""
    )


def choose(page, key: str) -> None:
    page.execute_script(
        "const s = document.getElementById('metric'); s.value = arguments[0]; s.dispatchEvent(new Event('change'))", key
    )


def table(page) -> dict:
    """The summary table: {job id: {column key: (text, data-value)}}, and the chosen metric's header."""
    rows = page.execute_script(
        """return Array.from(document.querySelectorAll('#summary tbody tr')).map(tr => [tr.dataset.job,
          Array.from(tr.querySelectorAll('td[data-key]')).map(td => [td.dataset.key, td.innerText, td.dataset.value])])"""
    )
    return {job: {k: (text, value) for k, text, value in cells} for job, cells in rows}


def whole_ticks(ticks: list, first: int, last: int) -> None:
    """x ticks at whole steps only, labelled as such, none before the first step or past the last."""
    values = [v for v, _, _ in ticks]
    assert values and all(float(v).is_integer() for v in values), ticks
    assert [t for _, t, _ in ticks] == [str(int(v)) for v in values], ticks
    assert values[0] == first and values[-1] == last, (ticks, first, last)


def test_compare_metric_choice_and_summary(server, page, runs, tmp_path):  # noqa: F811
    a, b = runs["preference"], runs["online"]
    page.get(f"{server.url}/compare?ids={a},{b}")
    wait_for(lambda: dom(page, "#summary td[data-key=steps]") == ["3", "4"], 30, "the summary table")
    options = dom(page, "#metric option", "value")
    # Train loss first (the default), eval loss next, then every other key either run logged.
    assert options[:2] == ["loss", "eval_loss"] and dom(page, "#metric", prop="value") == ["loss"], options
    assert {"reward", "reward_accuracy", "eval_reward_accuracy", "reward_exact_answer", "kl", "lr"} <= set(options)
    assert not {"step", "elapsed_s", "tokens", "stage"} & set(options)
    st = chart(page)
    assert st["metric"] == "loss" and st["series"] == [[a, [[1, 2.0], [2, 1.7], [3, 1.4]]], [b, [[2, 0.3], [4, 0.2]]]]
    whole_ticks(st["xticks"], 1, 4)
    rows = table(page)
    assert rows[a] == {
        "steps": ("3", "3"),
        "tokens": ("330", "330"),
        "elapsed_s": ("3.5 s", "3.5"),
        "loss": ("1.4", "1.4"),
        "best_eval_loss": ("1.8", "1.8"),
        "eval_loss": ("1.9", "1.9"),
        "selected": ("1.4", "1.4"),
    }, rows[a]
    assert rows[b] == {
        "steps": ("4", "4"),
        "tokens": ("≈840", "840"),
        "elapsed_s": ("6.5 s", "6.5"),
        "loss": ("0.2", "0.2"),
        "best_eval_loss": ("—", ""),  # never evaluated: a dash, not 0
        "eval_loss": ("—", ""),
        "selected": ("0.2", "0.2"),
    }, rows[b]
    assert dom(page, "#summary-metric") == ["final loss"]
    # Eval loss: the preference run's eval lines on their own steps, dotted; the online run has none.
    choose(page, "eval_loss")
    st = chart(page)
    assert st["metric"] == "eval_loss" and st["series"] == [[a, [[2, 1.8], [3, 1.9]]]] and st["dots"] == [a, a]
    assert dom(page, "#metric-note") == [f"not logged by {b}"]
    assert dom(page, "#summary-metric") == ["final eval_loss"]
    assert {job: row["selected"] for job, row in table(page).items()} == {a: ("1.9", "1.9"), b: ("—", "")}
    whole_ticks(chart(page)["xticks"], 2, 3)
    # A reward metric of the online run: its series alone; a logged 0 is shown as 0, not as a gap.
    choose(page, "reward")
    st = chart(page)
    assert st["metric"] == "reward" and st["series"] == [[b, [[2, 0.25], [4, 0.5]]]] and st["dots"] == []
    assert {job: row["selected"] for job, row in table(page).items()} == {a: ("—", ""), b: ("0.5", "0.5")}
    choose(page, "zero_variance_groups")
    assert {job: row["selected"] for job, row in table(page).items()} == {a: ("—", ""), b: ("0", "0")}
    # The choice is in the address: a reload (or a shared link) shows the same metric.
    assert "metric=zero_variance_groups" in page.current_url
    page.refresh()
    wait_for(lambda: chart(page)["metric"] == "zero_variance_groups", 30, "the metric from the address")
    page.save_screenshot(str(shots(tmp_path) / "page-compare-metric.png"))


def test_x_axis_of_one_step(server, page, runs):  # noqa: F811
    """One logged step: one tick, under the point, which sits mid-axis (not a tick "2" past the
    data, nor the lone "1" of a range cut short)."""
    short = runs["short"]
    page.get(f"{server.url}/compare?ids={short},{runs['none']}")
    wait_for(lambda: chart(page)["series"], 30, "the chart")
    st = chart(page)
    assert st["series"] == [[short, [[1, 3.0]]]], st
    whole_ticks(st["xticks"], 1, 1)
    (left, right), x = st["edges"], st["xticks"][0][2]
    assert abs(x - (left + right) / 2) < 0.5 and abs(float(st["points"][0].split(",")[0]) - x) < 0.5, st
    # The run with no lines: every cell a dash.
    assert {v for v in table(page)[runs["none"]].values()} == {("—", "")}
    assert dom(page, "#metric-note") == [f"not logged by {runs['none']}"]


def test_phone_width_keeps_values_in_view(server, page, runs, tmp_path):  # noqa: F811
    """At 390 px no page scrolls sideways. The job page's evaluation table wraps its text cells (a
    results file's name, a task) so that its value columns are on screen, each number on one line;
    the compare summary, wider than the phone, scrolls in its own box, its last value column brought
    into view by scrolling it while the run's id (the first column) stays in view."""
    run = Path(client(server, server.read).get(f"/api/jobs/{runs['preference']}").json()["run_dir"])
    (run / "eval").mkdir(exist_ok=True)
    (run / "eval" / "lm_eval-20240101-120000.json").write_text(
        json.dumps({"results": {"arc_easy_long_task_name": {"acc,none": 0.51234, "acc_stderr,none": 0.0123}}})
    )
    (run / "eval" / "preference-20240101-130000.json").write_text(
        json.dumps({"pairs": 8, "reward_accuracy": 0.75, "reward_margin": 0.25})
    )
    page.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", PHONE)
    try:
        page.get(f"{server.url}/jobs/{runs['preference']}")
        wait_for(lambda: len(dom(page, "#evaluation tbody tr")) == 3, 30, "the evaluation rows")
        inner, scroll, box = page.execute_script(
            """const b = document.querySelector('#evaluation').parentElement;
            return [innerWidth, document.documentElement.scrollWidth, [b.scrollWidth, b.clientWidth]]"""
        )
        assert inner == 390 and scroll <= inner and box[0] <= box[1], (inner, scroll, box)
        cells = page.execute_script(
            """return Array.from(document.querySelectorAll('#evaluation tbody td.whole')).map(td => {
              const r = document.createRange(); r.selectNodeContents(td); const b = td.getBoundingClientRect();
              return [td.innerText, b.left, b.right, r.getClientRects().length]})"""
        )
        shown = [(text, lines) for text, left, right, lines in cells if text and 0 <= left < right <= inner]
        assert shown == [("0.7500", 1), ("0.2500", 1), ("0.5123", 1), ("0.0123", 1)], cells
        page.execute_script("document.querySelector('#evaluation').scrollIntoView()")
        page.save_screenshot(str(shots(tmp_path) / "page-compare-phone-evaluation.png"))
        page.get(f"{server.url}/compare?ids={runs['preference']},{runs['online']}")
        wait_for(lambda: dom(page, "#summary td[data-key=steps]") == ["3", "4"], 30, "the summary table")
        inner, scroll = page.execute_script("return [innerWidth, document.documentElement.scrollWidth]")
        assert inner == 390 and scroll <= inner, (inner, scroll)
        box, last, first = page.execute_script(
            """const box = document.querySelector('#summary').parentElement, r = e => e.getBoundingClientRect();
            const sizes = [box.scrollWidth, box.clientWidth]; box.scrollLeft = box.scrollWidth;
            const row = document.querySelector('#summary tbody tr');
            return [sizes, [r(row.lastElementChild).left, r(row.lastElementChild).right],
              [r(row.firstElementChild).left, r(row.firstElementChild).right, r(box).left]]"""
        )
        assert box[0] > box[1], box  # the control: wider than the phone, in its own box
        assert 0 <= last[0] < last[1] <= inner + 0.5, last
        assert abs(first[0] - first[2]) < 1 and first[1] <= last[0], first  # the id column stays put
        page.save_screenshot(str(shots(tmp_path) / "page-compare-phone.png"))
    finally:
        page.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_docs_link(server, page):  # noqa: F811
    """The page links the API docs (Swagger UI at /docs), which open for the logged-in page."""
    page.get(server.url + "/")
    href = wait_for(lambda: dom(page, "#api-docs", prop="href"), 15, "the docs link")
    assert href == [server.url + "/docs"], href
    page.get(href[0])
    wait_for(lambda: dom(page, ".swagger-ui .title"), 30, "Swagger UI")
    assert "scaletune" in page.title


def test_log_out_sits_beside_who_is_signed_in(server, page):  # noqa: F811
    """The Log out button is in the top-right "signed in as" line, on its line: it was in a `<p>`,
    which a `<form>` closes, so it fell out of that line to the left, above the title."""
    page.get(server.url + "/")
    wait_for(lambda: dom(page, "#logout", visible=True), 15, "the Log out button")
    placed = page.execute_script(
        """const b = document.getElementById('logout'), who = document.getElementById('whoami');
        const r = b.getBoundingClientRect(), w = who.getBoundingClientRect();
        return [b.closest('#who') !== null, r.top < w.bottom && w.top < r.bottom, r.left > w.right];"""
    )
    assert placed == [True, True, True], placed


def test_samples_follow_the_phase(server, page, module_tmp_path):  # noqa: F811
    """A running job's samples are read again when its phase changes (the run writes the "before
    training" answers once it has loaded its model, while it stays running): a phase change is a
    `state` event, which rewrites #state, whose observer reads the samples again. The control: the
    file alone, with no event, is not shown. The phase's label shows while it has one, and the empty
    evaluation says so (issue 39 item 11's polish)."""
    import time

    from scaletune.serve.jobs.db import Job
    from scaletune.serve.jobs.records import set_state

    run = module_tmp_path / "sampling"
    job_id = plant_job(server.svc, run, state="running", owner="submit", phase="loading model")
    page.get(f"{server.url}/jobs/{job_id}")
    wait_for(lambda: dom(page, "#samples .empty") == ["no samples yet"], 30, "the empty samples")
    (run / "samples.jsonl").write_text(json.dumps({"prompt": "2+2?", "base": "five"}) + "\n")
    time.sleep(2)
    assert dom(page, "#samples .empty") == ["no samples yet"]  # nothing told the page yet
    with server.svc.Session() as s:
        set_state(s, s.get(Job, job_id), "running", phase="training")
        s.commit()
    wait_for(lambda: dom(page, "#samples tr.sample") == ["2+2?\tfive\t(not yet)"], 30, "the base answers")
    assert dom(page, "#phase") == ["training"] and [t.strip() for t in dom(page, "#phase-part", visible=True)] == [
        "phase training ·"
    ]
    # An empty evaluation says so (no bare table head); its note names the commands as code.
    assert dom(page, "#evaluation-empty", visible=True) and not dom(page, "#evaluation", visible=True)
    assert "`" not in dom(page, "#evaluation-note")[0] and len(dom(page, "#evaluation-note code")) == 2
    # An ended job has no phase: no empty "phase ·" label (it showed one).
    with server.svc.Session() as s:
        set_state(s, s.get(Job, job_id), "succeeded")
        s.commit()
    wait_for(lambda: dom(page, "#state") == ["succeeded"], 30, "the job's end")
    wait_for(lambda: not dom(page, "#phase-part", visible=True), 30, "the phase label gone")
