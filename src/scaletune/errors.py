"""Problems and the exceptions that the command line maps to exit codes (DESIGN.md: 2 for bad
input, 1 otherwise). Every `*_problems` function returns :class:`Problem` objects; they become text
at the edge, where they are raised (:class:`UserError`) or printed."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the input.

    Attributes:
        check: the rule's name ("batch arithmetic", "run directory", "chat template", ...).
        key: the dotted config key it is about (for `file:line`), or None.
        message: what is wrong; names the file or value where known.
        fix: what to do, or "".
    """

    check: str
    key: str | None
    message: str
    fix: str = ""

    def text(self, where: str | None = None) -> str:
        """The problem as one line; `where` (a `file:line` location) goes first."""
        head = f"{where}: " if where else ""
        return head + self.message + (f"; {self.fix}" if self.fix else "")


def texts(problems: Iterable[Problem | str]) -> list[str]:
    """Problems as lines (a string is already one)."""
    return [p.text() if isinstance(p, Problem) else p for p in problems]


def problems_of(exc: UserError, check: str) -> list[Problem]:
    """The problems of a raised error (text already: `file:line: ...`) as :class:`Problem` objects
    of `check`, to be reported with others; `text()` gives the same lines back."""
    return [Problem(check, None, p) for p in exc.problems]


class UserError(ValueError):
    """Bad input (config, data, arguments): the CLI prints every problem and exits with code 2.

    Args:
        problems: the problems (:class:`Problem`, or text already located: `file:line: key: ...`);
            each should name the file, line and key where known.
        title: a one-line heading printed above the problems.
    """

    def __init__(self, problems: Iterable[Problem | str] | Problem | str, title: str = "invalid input") -> None:
        if isinstance(problems, str | Problem):
            problems = [problems]
        self.problems = texts(problems)
        self.title = title
        super().__init__(self.format())

    def format(self) -> str:
        if len(self.problems) == 1:
            return f"{self.title}: {self.problems[0]}"
        lines = [f"{self.title} ({len(self.problems)} problems):"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


class ConfigError(UserError):
    """The YAML config or its overrides are invalid."""


class DataError(UserError):
    """A data file is missing, malformed or empty after filtering."""


class RunFailure(RuntimeError):
    """A run that cannot go on for a reason outside its input (the disk filled up while saving): the
    command line prints the message, without a traceback, and exits 1. The message says what
    happened, where, and what is intact."""
