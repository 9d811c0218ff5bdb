"""Progress of a long phase that has no optimizer steps to report: the sample answers before and
after training, an evaluation pass. On a slow CPU either can take many minutes, and a run that
prints nothing for that long looks hung (issue 40: 27 minutes before the first step line).

On rank 0 only: one counted line at most every `every_s` seconds and one at the end, so
redirected logs stay short. Lines, not a live bar, on a terminal too: an eval pass runs while the
training's progress bar is live, and two live displays on one terminal overwrite each other.
"""

from __future__ import annotations

import time
from typing import Any

from scaletune import env


class PhaseProgress:
    """`[scaletune] eval at step 10: 12/40 micro-batches, 31 s, eta 00:01:12` as `advance` is called.

    Args:
        what: the phase, as the line names it.
        total: the units the phase has (an upper bound: generation may stop early).
        unit: what is counted (`micro-batches`, `tokens`).
        every_s: the least time between two counted lines (seconds).
    """

    def __init__(self, what: str, total: int, unit: str, *, every_s: float = 10.0) -> None:
        self.what, self.total, self.unit, self.every_s = what, max(0, total), unit, every_s
        self.done = 0
        self.t0 = self.last = time.perf_counter()
        self.printed = -1
        self.active = env.current_rank() == 0 and self.total > 0

    def advance(self, n: int = 1) -> None:
        if not self.active:
            return
        self.done = min(self.total, self.done + n)
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            self._line(now)

    def close(self) -> None:
        """The last counted line."""
        if not self.active:
            return
        if self.printed != self.done:
            self._line(time.perf_counter())
        self.active = False

    def _line(self, now: float) -> None:
        elapsed = now - self.t0
        left = ""
        if 0 < self.done < self.total:
            eta = elapsed / self.done * (self.total - self.done)
            left = f", eta {time.strftime('%H:%M:%S', time.gmtime(eta))}"
        env.print0(f"[scaletune] {self.what}: {self.done}/{self.total} {self.unit}, {elapsed:.0f} s{left}")
        self.printed = self.done

    def __enter__(self) -> PhaseProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tracked(items: Any, progress: PhaseProgress) -> Any:
    """`items`, advancing `progress` by one after each."""
    for item in items:
        yield item
        progress.advance()
