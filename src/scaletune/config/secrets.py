"""Which values are secrets, and keeping them out of everything scaletune writes: saved configs,
logs, generated scripts and apps. A secret is passed by reference (the environment of the process
that runs the job, a Modal Secret, a 0600 env file), never by value in a file.

A `distributed.env` variable is secret when its name says so (:func:`is_secret_name`: the words
TOKEN, SECRET, PASSWORD/PASSWD/PASS/PWD/PASSPHRASE, KEY, CREDENTIAL(S), AUTH, COOKIE, PRIVATE,
SESSION, SIGNATURE, PAT, WEBHOOK as parts of the name, so `HF_TOKEN`, `DB_PASS`, `OPENAI_KEY`,
`PRIVATE_KEY`, `AWS_SECRET_ACCESS_KEY`, `GITHUB_PAT`)
or when `distributed.secret_env` lists it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "<redacted>"
_WORDS = {
    "TOKEN",
    "TOKENS",
    "SECRET",
    "SECRETS",
    "PASSWORD",
    "PASSWD",
    "PASS",
    "PWD",
    "KEY",
    "KEYS",
    "APIKEY",
    "CREDENTIAL",
    "CREDENTIALS",
    "CREDS",
    "AUTH",
    "COOKIE",
    "PRIVATE",
    "SESSION",
    "SIGNATURE",
    "PAT",
    "PASSPHRASE",
    "WEBHOOK",
}
_SPLIT = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z])(?=[A-Z])")


def is_secret_name(name: str, extra: Iterable[str] = ()) -> bool:
    """True for variable names that usually hold credentials, or that `extra` lists.

    The name is split into words (at `_`, `-`, `.` and lowerCamel boundaries) and any word in the
    list of the module docstring marks it: `HF_TOKEN`, `WANDB_API_KEY`, `DB_PASS`, `OPENAI_KEY`,
    `PRIVATE_KEY` are secret; `NCCL_DEBUG`, `OMP_NUM_THREADS` are not.
    """
    if name in set(extra):
        return True
    words = {w.upper() for w in _SPLIT.split(name) if w}
    return bool(words & _WORDS) or name.upper().endswith(("TOKEN", "SECRET", "PASSWORD", "APIKEY"))


def secret_names(env: Mapping[str, Any], extra: Iterable[str] = ()) -> list[str]:
    """Sorted names of the secret variables of `env`."""
    extra = list(extra)
    return sorted(k for k in env if is_secret_name(k, extra))


def redacted_env(env: Mapping[str, Any], extra: Iterable[str] = ()) -> dict[str, Any]:
    """`env` with every secret value replaced by `<redacted>`."""
    extra = list(extra)
    return {k: (REDACTED if is_secret_name(k, extra) else v) for k, v in env.items()}
