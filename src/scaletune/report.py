"""Reporting a run to a `scaletune serve` service: rank 0 posts its metrics lines, phases and
checkpoints in batches to the job's report endpoint, authenticated with a token scoped to that
job. The service gives both by reference in the environment (`SCALETUNE_REPORT_URL`,
`SCALETUNE_REPORT_TOKEN`); the token is never written to a file, a log or the saved config.
Where the service cannot be reached the run goes on; it still writes `metrics.jsonl`, which the
service reads later."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable, Mapping

URL_ENV, TOKEN_ENV, STOP_ENV = "SCALETUNE_REPORT_URL", "SCALETUNE_REPORT_TOKEN", "SCALETUNE_STOP_FILE"
BATCH = 16  # records per post at most
INTERVAL_S = 1.0  # a partial batch is posted after this long
RETRY_S = 30.0  # after a failed post, wait this long before trying again


class Reporter:
    """Batched posts of `{"events": [{"kind", "data"}, ...]}`; a no-op without the variables."""

    def __init__(self, environ: Mapping[str, str] | None = None, *, active: bool = True) -> None:
        env = os.environ if environ is None else environ
        self.url = env.get(URL_ENV) if active else None
        self._token = env.get(TOKEN_ENV, "")
        self._buffer: list[dict] = []
        self._last = time.monotonic()
        self._down_until = 0.0

    def add(self, kind: str, data: dict, *, flush: bool = False) -> None:
        if not self.url:
            return
        self._buffer.append({"kind": kind, "data": data})
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
