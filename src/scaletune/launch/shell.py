"""Shell text the builders write: quoting (every value `shlex`-quoted unless a builder marks a
fragment :class:`Raw`) and secret pass-through lines. The scripts themselves are rendered by
their builders (:meth:`~scaletune.launch.commands.LaunchCommand.script`, :mod:`.slurm`,
:mod:`.modal_app`); this module imports none of them."""

from __future__ import annotations

import shlex
from collections.abc import Sequence


class Raw(str):
    """A shell fragment written verbatim (e.g. `"$MASTER_ADDR"`). Only builders create these,
    never from user input; everything else is `shlex.quote`d."""


def quote(token: str) -> str:
    return str(token) if isinstance(token, Raw) else shlex.quote(str(token))


def shell_join(argv: Sequence[str]) -> str:
    """The argv as one shell line; literal tokens quoted, :class:`Raw` tokens verbatim."""
    return " ".join(quote(t) for t in argv)


def secret_passthrough_lines(names: Sequence[str], header: bool = True) -> list[str]:
    """Shell lines for secret variables: a comment saying they are not written down, and a
    warning at run time when one is missing from the environment."""
    if not names:
        return []
    out = []
    if header:
        out += [
            "# Secrets are never written into this script: they are passed through from the",
            "# environment of whoever runs it (export them before, or use your secret store).",
        ]
    for n in names:
        out.append(f'[ -n "${{{n}+x}}" ] || echo "warning: {n} is not set in the environment" >&2')
    return out
