"""The command line's `key.path=value` overrides: parsed (values are YAML), applied to a config
mapping, and their secrets taken out, one rule for every form (`distributed.env.HF_TOKEN=X`,
`distributed.env={HF_TOKEN: X}`, `distributed={env: {HF_TOKEN: X}}`) and every user of it: the
CLI's re-execution and launch scripts, and a submission to the service."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from scaletune.config import yamlfile
from scaletune.config.secrets import is_secret_name

__all__ = ["parse_override", "public_overrides", "set_path", "split_secret_override"]


def parse_override(item: str) -> tuple[list[str], Any]:
    """`training.learning_rate=1e-4` -> (["training", "learning_rate"], 1e-4). Values are YAML
    (read as a config file is: no duplicate keys, bounded aliases); a value that is not valid YAML
    is taken as a string.

    Raises:
        ValueError: no `=`, an empty key part, or a YAML value that is refused (its reason).
    """
    if "=" not in item:
        raise ValueError(f"override {item.split()[0][:40]!r}... is not of the form key.path=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ValueError(f"override for {key!r} has an empty key part")
    if not raw.strip():
        return parts, None
    value, _, problems = yamlfile.parse(raw.encode(), f"override {key}")
    if problems and any("not valid YAML" in p for p in problems):
        return parts, raw
    if problems:
        raise ValueError("; ".join(problems))
    return parts, value


def set_path(data: dict, parts: list[str], value: Any) -> None:
    """Set `data[parts[0]]...[parts[-1]] = value` in place, making (or replacing by) a mapping at each
    key on the way: how an override (`parse_override`) applies, for the CLI, the page's form and a
    submission to the service alike."""
    node = data
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[parts[-1]] = value


def split_secret_override(item: str, extra: Iterable[str] = ()) -> tuple[str | None, dict[str, str]]:
    """`item` without the secret `distributed.env` values it sets, whatever its form, and those
    values: (the override to store, write or pass on, or None when it set nothing else; name ->
    value). An override that does not parse is returned as it is (the config check names it).
    `extra`: `distributed.secret_env`'s names."""
    try:
        parts, value = parse_override(item)
    except ValueError:
        return item, {}
    nested: dict = {}
    set_path(nested, parts, value)
    dist = nested.get("distributed")
    env = dist.get("env") if isinstance(dist, dict) else None
    extra = list(extra)
    hidden = [k for k in env if is_secret_name(str(k), extra)] if isinstance(env, dict) else []
    if not hidden:
        return item, {}
    secrets = {str(k): str(env.pop(k)) for k in hidden}
    if parts[:2] == ["distributed", "env"] and len(parts) > 2:
        return None, secrets  # the override set a secret variable itself (or a part of one)
    rest: Any = nested
    for p in parts:
        rest = rest[p]
    return f"{'.'.join(parts)}={json.dumps(rest, default=str)}", secrets


def public_overrides(overrides: Sequence[str], extra: Iterable[str] = ()) -> list[str]:
    """The command-line overrides without the secrets they set (`split_secret_override`): what may
    be written into a script, a log or a job record. The secret values themselves reach the ranks
    through their environment."""
    extra = list(extra)
    return [public for item in overrides if (public := split_secret_override(item, extra)[0]) is not None]
