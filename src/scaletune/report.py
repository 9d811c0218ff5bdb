"""The run <-> serve protocol, defined once: the environment variables a service hands a run, the
kinds of events a run reports, the one-line form those events take in the run's log (the writer
and the parser side by side), and the reporter that posts them.

A `scaletune serve` job's run gets its report endpoint and a token scoped to that job by
reference in the environment (:data:`URL_ENV`, :data:`TOKEN_ENV`); the token is never written to a
file, a log or the saved config. Rank 0 posts its metrics lines, phases and checkpoints in batches;
where the service cannot be reached the run goes on, and the service reads `metrics.jsonl` and the
event lines of the log (:func:`parse_event_line`) instead. The service asks a run to stop by
creating the file :data:`STOP_ENV` names."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any

URL_ENV = "SCALETUNE_REPORT_URL"  # the job's report endpoint (POST {"events": [...]})
TOKEN_ENV = "SCALETUNE_REPORT_TOKEN"  # its bearer token, valid for that job only
STOP_ENV = "SCALETUNE_STOP_FILE"  # a path; the run stops (checkpoint, exit 0) once it exists
BATCH = 16  # records per post at most
INTERVAL_S = 1.0  # a partial batch is posted after this long
RETRY_S = 30.0  # after a failed post, wait this long before trying again

# What a running job is doing, as the trainer reports it and the service shows it.
PHASES = ("loading model", "loading data", "training", "evaluating", "checkpointing", "exporting")


class EventKind(StrEnum):
    """The kind of a reported event; the value is the `kind` of a post, `words` starts its log line.

    data per kind: METRIC a metrics.jsonl record (posted only: the file is its log);
    PHASE `phase` (one of :data:`PHASES`), optional `step` (int) and `stage` (str);
    CHECKPOINT `step` (int) and `path` (str); STOPPED `step` (int).
    """

    METRIC = "metric"
    PHASE = "phase"
    CHECKPOINT = "checkpoint"
    STOPPED = "stopped"

    @property
    def words(self) -> str:
        return _WORDS[self]

    @classmethod
    def named(cls, name: str) -> EventKind:
        """The kind of `name`: a post's kind or the words of a log line ("saved checkpoint").

        Raises:
            ValueError: no such kind.
        """
        for kind in cls:
            if name in (kind.value, _WORDS.get(kind)):
                return kind
        raise ValueError(f"unknown event kind {name!r}; known: {[k.value for k in cls]}")


_WORDS = {EventKind.PHASE: "phase", EventKind.CHECKPOINT: "saved checkpoint", EventKind.STOPPED: "stopped on request"}
PREFIX = "[scaletune] "
# torchrun's `--local-ranks-filter`/`--tee` prefix in front of a rank's output.
_RANK_PREFIX = re.compile(r"\[rank\d+\]: ")
_LINES = {
    EventKind.PHASE: re.compile(
        rf"phase: (?P<phase>{'|'.join(map(re.escape, PHASES))})"
        r"(?: at step (?P<step>\d+))?(?: \(stage (?P<stage>.+)\))?"
    ),
    EventKind.CHECKPOINT: re.compile(r"saved checkpoint: step (?P<step>\d+) in (?P<path>.*)"),
    EventKind.STOPPED: re.compile(r"stopped on request at step (?P<step>\d+)"),
}


def _one_line(value: Any) -> str:
    # A line break inside a value (a path, a stage name) would split the event in two; every
    # character str.splitlines breaks at, as the service's reader does.
    return " ".join(str(value).splitlines())


def event_line(kind: EventKind | str, data: Mapping[str, Any]) -> str:
    """The log line of an event, in plain words, e.g. `[scaletune] phase: training (stage main)`,
    `[scaletune] saved checkpoint: step 40 in runs/x/checkpoints/step-40`. :func:`parse_event_line`
    reads it back as `(kind, data)`; a line break inside a value becomes a space.

    Raises:
        ValueError: a kind without a log line (METRIC), a missing field or a phase not in PHASES.
    """
    kind = EventKind.named(kind)
    try:
        if kind is EventKind.PHASE:
            if data["phase"] not in PHASES:
                raise ValueError(f"phase {data['phase']!r}: one of {PHASES}")
            text = f"phase: {data['phase']}"
            if data.get("step") is not None:
                text += f" at step {int(data['step'])}"
            if data.get("stage"):
                text += f" (stage {_one_line(data['stage'])})"
        elif kind is EventKind.CHECKPOINT:
            text = f"saved checkpoint: step {int(data['step'])} in {_one_line(data['path'])}"
        elif kind is EventKind.STOPPED:
            text = f"stopped on request at step {int(data['step'])}"
        else:
            raise ValueError(f"{kind.value} events have no log line")
    except KeyError as exc:
        raise ValueError(f"a {kind.value} event needs {exc.args[0]!r}") from None
    return PREFIX + text


def parse_event_line(line: str) -> tuple[EventKind, dict[str, Any]] | None:
    """`(kind, data)` of a line :func:`event_line` wrote (torchrun's `[rankN]: ` prefix allowed;
    `step` an int); None for any other line."""
    line = line.rstrip("\r\n")
    m = _RANK_PREFIX.match(line)
    text = line[m.end() :] if m else line
    if not text.startswith(PREFIX):
        return None
    text = text[len(PREFIX) :]
    for kind, pattern in _LINES.items():
        found = pattern.fullmatch(text)
        if found:
            data = {k: int(v) if k == "step" else v for k, v in found.groupdict().items() if v is not None}
            return kind, data
    return None


class Reporter:
    """Batched posts of `{"events": [{"kind", "data"}, ...]}`; a no-op without the variables."""

    def __init__(self, environ: Mapping[str, str] | None = None, *, active: bool = True) -> None:
        env = os.environ if environ is None else environ
        self.url = env.get(URL_ENV) if active else None
        self._token = env.get(TOKEN_ENV, "")
        self._buffer: list[dict] = []
        self._last = time.monotonic()
        self._down_until = 0.0

    def add(self, kind: EventKind | str, data: dict, *, flush: bool = False) -> None:
        """Queue one event (`kind`: an :class:`EventKind` or its name); posts when due or `flush`."""
        kind = EventKind.named(kind)
        if not self.url:
            return
        self._buffer.append({"kind": kind.value, "data": data})
        if flush or len(self._buffer) >= BATCH or time.monotonic() - self._last >= INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        if not self.url or not self._buffer or time.monotonic() < self._down_until:
            return
        body = json.dumps({"events": self._buffer}).encode()
        req = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self._token}"},
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                resp.read()
            self._buffer = []
        except OSError:  # unreachable or refused: metrics.jsonl is the fallback
            self._down_until = time.monotonic() + RETRY_S
        self._last = time.monotonic()


_REPORTER: Reporter | None = None


def reporter() -> Reporter:
    """This process's reporter (from its environment), made once."""
    global _REPORTER
    if _REPORTER is None:
        _REPORTER = Reporter()
    return _REPORTER


class RunStopped(Exception):  # noqa: N818 - a control-flow signal, not an error
    """A stop was requested (`scaletune serve`): a checkpoint was saved, the run ends resumable."""


def stop_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the service asked this run to stop: the file `SCALETUNE_STOP_FILE` names exists."""
    path = (os.environ if environ is None else environ).get(STOP_ENV)
    return bool(path) and os.path.exists(path)


def stop_agreed(all_reduce_sum: Callable) -> bool:
    """Whether any rank sees a stop request; every rank calls this at the same step boundary.

    Args:
        all_reduce_sum: the strategy's sum over ranks of a CPU tensor.
    """
    if not os.environ.get(STOP_ENV):  # not watched (the same on every rank): no collective, no sync
        return False
    import torch

    return float(all_reduce_sum(torch.tensor([float(stop_requested())], dtype=torch.float64))[0]) > 0


def json_lines(text: str) -> list[dict]:
    """The JSON objects of `text`, one a line (a run's metrics.jsonl, samples.jsonl); other lines,
    such as one cut off mid-write, are skipped."""
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
