"""The run <-> serve protocol (`scaletune.report`): every event kind's log line reads back as what
was written, the line is the plain words a person reads, and the service's log reader takes the
exact line `Trainer.report` prints (the real writer, the real reader)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scaletune.report import PHASES, EventKind, Reporter, event_line, parse_event_line

# Values as a run has them: a str.splitlines line break would split the event (tested apart).
one_line = st.text(min_size=1).filter(lambda s: s.splitlines() == [s])
steps = st.integers(min_value=0, max_value=10**12)
phases = st.fixed_dictionaries({"phase": st.sampled_from(PHASES)}, optional={"step": steps, "stage": one_line}).map(
    lambda d: (EventKind.PHASE, d)
)
checkpoints = st.fixed_dictionaries({"step": steps, "path": st.text().filter(lambda s: s.splitlines() == [s] or not s)})
events = st.one_of(
    phases,
    checkpoints.map(lambda d: (EventKind.CHECKPOINT, d)),
    st.fixed_dictionaries({"step": steps}).map(lambda d: (EventKind.STOPPED, d)),
)


@given(events, st.sampled_from(["", "[rank0]: ", "[rank12]: "]))
def test_every_kind_round_trips(event, rank_prefix):
    kind, data = event
    line = event_line(kind, data)
    assert line.splitlines() == [line]
    assert parse_event_line(rank_prefix + line + "\n") == (kind, data)


@pytest.mark.parametrize(
    ("kind", "data", "line"),
    [
        ("phase", {"phase": "loading data"}, "[scaletune] phase: loading data"),
        ("phase", {"phase": "training", "stage": "sft"}, "[scaletune] phase: training (stage sft)"),
        ("phase", {"phase": "checkpointing", "step": 40}, "[scaletune] phase: checkpointing at step 40"),
        (
            "saved checkpoint",
            {"step": 4, "path": "/r/checkpoints/step-4"},
            "[scaletune] saved checkpoint: step 4 in /r/checkpoints/step-4",
        ),
        ("stopped on request", {"step": 7}, "[scaletune] stopped on request at step 7"),
    ],
)
def test_lines_are_plain_words(kind, data, line):
    """The phase is said once (not `phase: phase=loading data`); the trainer's kind words work."""
    assert event_line(kind, data) == line
    assert parse_event_line(line) == (EventKind.named(kind), data)


def test_line_breaks_in_values_stay_on_one_line():
    line = event_line(EventKind.CHECKPOINT, {"step": 1, "path": "/a\nb\x1cc\u2028"})
    assert line.splitlines() == [line]
    assert parse_event_line(line) == (EventKind.CHECKPOINT, {"step": 1, "path": "/a b c"})


@pytest.mark.parametrize(
    "line",
    [
        "[scaletune] stage main: 84 sequences, 11 steps per epoch",  # the trainer's other lines
        "[scaletune] training 3/4 loss 2.1000 lr 1.00e-04",
        "[scaletune] phase: dreaming",  # not a phase
        "[scaletune] phase: phase=loading data",  # the old key=value form
        "[scaletune] saved checkpoint: step x in /p",
        "phase: training",
        "",
    ],
)
def test_other_lines_are_not_events(line):
    assert parse_event_line(line) is None


def test_writer_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="phase 'dreaming'"):
        event_line("phase", {"phase": "dreaming"})
    with pytest.raises(ValueError, match="needs 'path'"):
        event_line("saved checkpoint", {"step": 1})
    with pytest.raises(ValueError, match="no log line"):
        event_line(EventKind.METRIC, {"step": 1})
    with pytest.raises(ValueError, match="unknown event kind"):
        EventKind.named("checkpoint saved")


def test_reporter_posts_the_kind_value_and_refuses_unknown_kinds():
    r = Reporter({"SCALETUNE_REPORT_URL": "http://127.0.0.1:9/x"})
    r.flush = lambda: None  # no network: the batch is what is checked
    r.add("saved checkpoint", {"step": 1, "path": "p"})
    r.add(EventKind.METRIC, {"step": 1})
    assert r._buffer == [
        {"kind": "checkpoint", "data": {"step": 1, "path": "p"}},
        {"kind": "metric", "data": {"step": 1}},
    ]
    with pytest.raises(ValueError):
        r.add("request", {})


def test_serve_reads_the_line_the_trainer_prints(tmp_path, capsys, monkeypatch):
    """Trainer.report's real output, in a job's log, read by the real watcher into a job record;
    what the trainer posts for the same event is what the reader makes of its line. A restarted
    watcher reads on from the offsets kept on the record: no line is read twice."""
    import scaletune.trainer.loop as loop
    from scaletune.serve.jobs.db import Event, Job, open_db
    from scaletune.serve.jobs.watch import Watcher

    posted = []
    monkeypatch.setattr(loop, "reporter", lambda: SimpleNamespace(add=lambda k, d, flush: posted.append((k, d))))
    trainer = SimpleNamespace(env=SimpleNamespace(is_main=True))
    ckpt = str(tmp_path / "run dir" / "checkpoints" / "step-2")
    # Saved, as the line says: the watcher offers the checkpoints whose folder exists.
    (tmp_path / "run dir" / "checkpoints" / "step-2").mkdir(parents=True)
    capsys.readouterr()
    loop.Trainer.report(trainer, "phase", phase="loading model")
    loop.Trainer.report(trainer, "phase", phase="training", stage="warm up")
    loop.Trainer.report(trainer, "saved checkpoint", step=2, path=ckpt)
    loop.Trainer.report(trainer, "stopped on request", step=2)
    printed = capsys.readouterr().err
    assert printed.splitlines()[0] == "[scaletune] phase: loading model"
    assert [parse_event_line(x) for x in printed.splitlines()] == posted
    assert [k for k, _ in posted] == ["phase", "phase", "checkpoint", "stopped"]

    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "train.log").write_text(
        "some library output\n" + "".join(f"[rank0]: {x}\n" for x in printed.splitlines())
    )
    engine, Session = open_db(f"sqlite:///{tmp_path / 'serve.db'}")

    def watcher() -> Watcher:
        return Watcher(Session, threading.RLock(), {}, files=lambda job: None, issue_token=lambda job: "")

    with Session() as s:
        fields = dict(config_yaml="", job_dir=str(job_dir), run_dir=str(tmp_path / "run dir"), token_hash="")
        s.add(Job(id="j1", state="starting", target="local", step=0, stop_requested=0, **fields))
        s.commit()
    for _ in range(2):  # the second: a restarted service, a new watcher
        with Session() as s:
            watcher().read_outputs(s, s.get(Job, "j1"))
            s.commit()
    with Session() as s:
        job = s.get(Job, "j1")
        assert (job.state, job.phase, job.stage) == ("running", "training", "warm up")
        assert job.offsets == {"train.log": (job_dir / "train.log").stat().st_size}
        rows = [(e.kind, e.data) for e in s.query(Event).order_by(Event.id)]
    assert [d for k, d in rows if k == "checkpoint"] == [{"step": 2, "path": ckpt}]
    assert [d["phase"] for k, d in rows if k == "state"] == ["loading model", "training"]
    assert len([d for k, d in rows if k == "log"]) == 4  # each scaletune line once
    engine.dispose()
