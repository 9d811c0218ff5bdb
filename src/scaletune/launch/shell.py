"""Shell text the builders write: quoting (every value `shlex`-quoted unless a builder marks a
fragment :class:`Raw`), secret pass-through lines, and the per-node launch script."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scaletune.launch.commands import LaunchCommand


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


def render_script(cmd: LaunchCommand, workdir: str | None) -> str:
    """A runnable, commented shell script for one node (`scaletune launch --script FILE`). Comments
    carry no user text (a newline in it would start a command); every value is quoted."""
    lines = ["#!/usr/bin/env bash", "# Written by `scaletune launch`."]
    lines += [
        f"# {cmd.summary}.",
        "# Run the script of each node on that node (node 0, the master, hosts the rendezvous;",
        "# workers wait for it up to the rendezvous timeout).",
        "set -euo pipefail",
    ]
    if workdir:
        lines += ["# Relative paths in the config are relative to this directory.", f"cd {shlex.quote(workdir)}"]
    if cmd.public_env:
        lines.append("# Environment: distributed.env from the config, then --env-preset (later wins).")
        lines += [f"export {k}={shlex.quote(v)}" for k, v in cmd.public_env.items()]
    lines += secret_passthrough_lines(cmd.secret_names)
    replace: dict[str, Raw] = {}
    for i, (path, text) in enumerate(cmd.files.items()):
        var = f"SCALETUNE_FILE_{i}"
        lines.append(f'{var}="$(mktemp)"')
        lines.append(f"cat >\"${var}\" <<'SCALETUNE_EOF'\n{text.rstrip()}\nSCALETUNE_EOF")
        replace[path] = Raw(f'"${var}"')
    argv = [replace.get(t, t) if not isinstance(t, Raw) else t for t in cmd.argv]
    lines.append(shell_join(argv))
    return "\n".join(lines) + "\n"
