"""Exceptions that the command line maps to exit codes (DESIGN.md: 2 for bad input, 1 otherwise)."""

from __future__ import annotations


class UserError(ValueError):
    """Bad input (config, data, arguments): the CLI prints every problem and exits with code 2.

    Args:
        problems: one message per problem; each should name the file, line and key where known.
        title: a one-line heading printed above the problems.
    """

    def __init__(self, problems: list[str] | str, title: str = "invalid input") -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
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
