"""The job page's reward-accuracy chart (issue 24): a real tiny DPO job's `reward_accuracy` and
`eval_reward_accuracy` drawn live on a second chart with a fixed 0..1 axis, in a real headless
Chromium, compared with the run's own metrics.jsonl; an SFT job's page (the control) shows no
such chart. Both jobs run for real through the service."""

from __future__ import annotations

import json

import yaml

from tests.helpers import REPO_ROOT, make_config, metrics, run_cli, wait_for
from tests.serve.serve_helpers import client, dom, wait_state

JOB = {"max_steps": 4, "save_every": 0, "micro_batch_size": 8, "eval_every": 2}
PAIRS = REPO_ROOT / "examples" / "data" / "alpaca_pairs.jsonl"
HELDOUT = REPO_ROOT / "examples" / "data" / "alpaca_pairs_heldout.jsonl"
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


def submit(server, cfg: dict) -> str:
    return client(server, server.submit).post("/api/jobs", json={"config": yaml.safe_dump(cfg)}).json()["id"]


def finish(server, job_id: str) -> None:
    c = client(server, server.submit)
    job = wait_state(c, job_id, {"succeeded", "failed", "cancelled"}, timeout=300)
    assert job["state"] == "succeeded", c.get(f"/api/jobs/{job_id}/logs").text[-3000:]


def dpo_config(model, out) -> dict:
    """A tiny LoRA DPO run on the shipped pairs, evaluated before the first step and every 2 steps."""
    return make_config(
        model,
        out,
        model={"lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
        data={
            "train": {"path": str(PAIRS), "format": "preference", "max_samples": 32},
            "eval": {"path": str(HELDOUT), "format": "preference", "max_samples": 8},
        },
        training={
            **JOB,
            "objective": "dpo",
            "global_batch_size": 8,
            "micro_batch_size": 4,
            "learning_rate": 5e-3,
            "eval_on_start": True,
        },
    )


def test_reward_accuracy_chart(server, page, tiny_model_dir, tmp_path):  # noqa: F811
    # The control: a real SFT job's page has its loss chart and no reward chart.
    sft = make_config(tiny_model_dir, tmp_path / "sft", training=JOB, data={"eval_fraction": 0.25})
    sft_id = submit(server, sft)
    finish(server, sft_id)
    sft_lines = metrics(tmp_path / "sft")
    assert any("eval_loss" in r for r in sft_lines) and not any(k in r for r in sft_lines for k in REWARD_KEYS)
    page.get(f"{server.url}/jobs/{sft_id}")
    wait_for(lambda: page.execute_script("return document.querySelectorAll('#chart polyline').length"), 30, "loss")
    chart = reward_chart(page)
    assert not chart["shown"] and chart["series"] == [], chart

    # A real DPO job, watched live from its submission: the chart appears with its first reward
    # line and ends showing exactly what metrics.jsonl holds.
    job_id = submit(server, dpo_config(tiny_model_dir, tmp_path / "dpo"))
    page.get(f"{server.url}/jobs/{job_id}")
    wait_for(lambda: reward_chart(page)["shown"], 240, "the reward chart")
    finish(server, job_id)
    lines = metrics(tmp_path / "dpo")
    want = expected(lines)
    assert set(want) == set(REWARD_KEYS) and len(want["eval_reward_accuracy"]) == 3, want  # steps 0, 2, 4
    assert len({v for _, v in want["reward_accuracy"] + want["eval_reward_accuracy"]}) > 1, want  # not flat
    wait_for(lambda: dom_series(page) == {k: len(v) for k, v in want.items()}, 60, "every reward line drawn")
    assert_chart_shows(reward_chart(page), want)
    # The main chart offers the run's other preference keys: reward_margin drawn as the lines hold it.
    options = page.execute_script("return Array.from(document.querySelectorAll('#series option')).map(o => o.value)")
    assert {"reward_margin", "logp_chosen", "logp_rejected"} <= set(options) and "kl" not in options, options
    drawn = page.execute_script(
        """const s = document.getElementById('series'); s.value = 'reward_margin'; s.onchange();
        return Array.from(document.querySelectorAll('#chart polyline')).map(p => p.getAttribute('data-values'));"""
    )
    margins = [(r["step"], r["reward_margin"]) for r in lines if "reward_margin" in r and "eval_loss" not in r]
    assert [[(int(x), float(y)) for x, y in (v.split(":") for v in d.split(" "))] for d in drawn] == [margins], drawn

    # `scaletune eval RUN --format preference` on the run's held-out pairs: its results file in the
    # run's eval/ is tabulated on the page as the JSON holds it (and agrees with the run's last eval).
    held = tmp_path / "heldout.jsonl"
    held.write_text("".join(HELDOUT.read_text().splitlines(keepends=True)[:8]))  # the run's max_samples
    proc = run_cli(["eval", str(tmp_path / "dpo"), "--data", str(held), "--format", "preference", "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["reward_accuracy"] == want["eval_reward_accuracy"][-1][1], (result, want)
    page.get(f"{server.url}/jobs/{job_id}")
    rows = wait_for(lambda: dom(page, "#evaluation tbody tr"), 30, "the evaluation table")
    shown = {tuple(r.split("\t")[1:4]) for r in rows}
    for metric in ("reward_accuracy", "reward_margin", "logp_chosen", "logp_rejected"):
        assert ("preference pairs (8)", metric, f"{result[metric]:.4f}") in shown, (metric, rows)


def dom_series(driver) -> dict[str, int]:
    return {s["label"]: len(s["values"].split(" ")) for s in reward_chart(driver)["series"]}
