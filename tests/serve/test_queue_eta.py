"""A queued job's start estimate (serve/jobs/records.py) on records in a real SQLite job database:
the running job's pace as its page computes it (over its latest start), the jobs ahead filling the
`--max-concurrent` slots in the watcher's order, the median of the jobs that finished here (a
resumed one left out), and "unknown" with what is missing where nothing supports a number. The
page's walk with a real queued job is tests/serve/test_page_actions.py."""

from __future__ import annotations

import datetime as dt

import pytest

from scaletune.serve.jobs.records import pace, queue_eta, start_after

T0 = dt.datetime(2026, 1, 1, 12, 0, 0)


def test_pace_is_measured_over_the_latest_start():
    first_run = [{"step": s, "elapsed_s": 4.0 * s, "total_steps": 10} for s in (1, 2)]
    resumed = [{"step": 3, "elapsed_s": 0.5, "total_steps": 10}, {"step": 5, "elapsed_s": 1.5, "total_steps": 10}]
    assert pace(first_run + resumed) == (0.5, 5, 10)  # 1 s over 2 steps, not the first start's 4 s a step
    assert pace(first_run) == (4.0, 2, 10)
    assert pace(resumed[:1]) is None  # one line: no pace yet
    assert pace([{"step": 1, "elapsed_s": 1.0}, {"step": 2, "elapsed_s": 2.0}]) is None  # no total_steps


def test_the_jobs_ahead_fill_the_slots_in_order():
    assert start_after([], [], 1) == 0  # a free slot
    assert start_after([30.0], [], 1) == 30
    assert start_after([30.0], [100.0, 100.0], 1) == 230
    assert start_after([30.0, 10.0], [100.0], 2) == 30  # the slot free at 10 takes the queued job
    assert start_after([5.0, 30.0, 10.0], [], 2) == 10  # three running on two slots: two must end
    assert start_after([], [50.0, 50.0, 50.0], 2) == 50


@pytest.fixture
def db(tmp_path):
    from scaletune.serve.jobs.db import open_db

    engine, Session = open_db(f"sqlite:///{tmp_path / 'serve.db'}")
    yield Session
    engine.dispose()


def _job(s, job_id: str, state: str, created: dt.datetime, starts=(), ended: dt.datetime | None = None):
    from scaletune.serve.jobs.db import Event, Job

    s.add(
        Job(id=job_id, state=state, target="local", config_yaml="", job_dir="/x", run_dir="/x", token_hash="",
            created=created, updated=ended or created)
    )  # fmt: skip
    for t in starts:
        s.add(Event(job_id=job_id, kind="state", data={"state": "starting"}, created=t))
    if ended is not None:
        s.add(Event(job_id=job_id, kind="state", data={"state": "succeeded"}, created=ended))


def test_estimate_from_the_running_pace_and_the_finished_jobs(db):
    from scaletune.serve.jobs.db import Job, Metric

    now = T0 + dt.timedelta(minutes=10)
    with db() as s:
        _job(s, "running", "running", T0, starts=[T0])
        for name in ("first", "second"):
            _job(s, name, "queued", T0 + dt.timedelta(minutes=1 if name == "first" else 2))
        s.commit()
        first, second = s.get(Job, "first"), s.get(Job, "second")
        # Nothing supports a number: the running job has logged no step and no job has finished.
        got = queue_eta(s, first, 1, now)
        assert (got["position"], got["start_in_s"], got["typical_s"]) == (1, None, None)
        assert got["why"] == (
            "unknown: job running (running): job running has logged no step yet, and no job has finished "
            "here to tell how long one takes"
        )
        # Its pace: 2 s a step, 90 of 100 steps left.
        for step in range(1, 11):
            s.add(Metric(job_id="running", step=step, kind="train", data={"step": step, "elapsed_s": 2.0 * step,
                                                                        "total_steps": 100}))  # fmt: skip
        s.commit()
        got = queue_eta(s, first, 1, now)
        assert got["start_in_s"] == pytest.approx(180.0) and got["ahead"][0]["remaining_s"] == pytest.approx(180.0)
        behind = queue_eta(s, second, 1, now)  # it needs the first one's duration: none finished
        assert behind["position"] == 2 and behind["start_in_s"] is None
        assert "job first (queued): no job has finished here" in behind["why"]
        # Finished jobs: 100 s and 300 s (median 200); a resumed one (two starts) is not one run's time.
        _job(s, "a", "succeeded", T0, starts=[T0], ended=T0 + dt.timedelta(seconds=100))
        _job(s, "b", "succeeded", T0, starts=[T0], ended=T0 + dt.timedelta(seconds=300))
        resumed = [T0, T0 + dt.timedelta(seconds=500)]
        _job(s, "c", "succeeded", T0, starts=resumed, ended=T0 + dt.timedelta(seconds=510))
        s.commit()
        behind = queue_eta(s, second, 1, now)
        assert (behind["typical_s"], behind["finished"]) == (200.0, 2)
        assert behind["start_in_s"] == pytest.approx(180.0 + 200.0)
        # Two slots: the first queued job takes the free one, the second the running job's at 180 s.
        assert queue_eta(s, second, 2, now)["start_in_s"] == pytest.approx(180.0)
        assert queue_eta(s, first, 2, now)["start_in_s"] == 0
        s.get(Job, "running").state = "succeeded"
        s.commit()
        assert queue_eta(s, second, 1, now)["start_in_s"] == 200.0  # behind the first queued job only
        assert queue_eta(s, s.get(Job, "a"), 1, now)["why"] == "job a is succeeded, not queued"
