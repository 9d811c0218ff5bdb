"""A submitted config as data: its text bounded (nesting), parsed as the CLI parses a file
(`config.yamlfile`), the overrides applied to a copy for the policy's rules, and its secrets taken
out. A secret value (a `distributed.env` variable `config.secrets` calls secret) is held by the
service in memory for the job's process environment, never written into the stored config, the
job record, the overrides or a command line: what is stored names it only (`secret_refs`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import yaml

from scaletune.config import is_secret_name, parse_override
from scaletune.config.overrides import set_path, split_secret_override  # the CLI's own rules
from scaletune.config.yamlfile import depth_problem, parse
from scaletune.errors import UserError


@dataclass
class Submission:
    """data: the config with the overrides applied (what the policy checks).
    text: the config to store and run (the submitted text, or without its secrets).
    overrides: the overrides to store and run (without secrets).
    secrets: name -> value, for the job's environment only."""

    data: dict
    text: str
    overrides: list[str]
    secrets: dict[str, str] = field(default_factory=dict)

    @property
    def secret_names(self) -> list[str]:
        return sorted(self.secrets)


def read(text: str, overrides: list[str], max_depth: int) -> Submission:
    """Parse a submission for the policy. Overrides that do not parse are left for the config check
    (which names them); their values are bounded like the text.

    Raises:
        UserError: the text nests too deep or is not a YAML mapping (before anything else).
    """
    problems = [p for p in [depth_problem(text, "config", max_depth)] if p]
    problems += [p for o in overrides if (p := depth_problem(o.partition("=")[2], "override", max_depth))]
    if problems:
        raise UserError(problems, title="invalid config")
    raw, _, problems = parse(text.encode(), "config")
    if problems:
        raise UserError(problems, title="invalid config")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError("config: the top level must be a mapping of keys", title="invalid config")
    data = json.loads(json.dumps(raw, default=str))  # a plain copy (dates as text)
    parsed: list[tuple[str, list[str], Any]] = []
    for item in overrides:
        try:
            parts, value = parse_override(item)
        except ValueError:
            parsed.append((item, [], None))
            continue
        parsed.append((item, parts, value))
        set_path(data, parts, value)
    extra = _get_list(data, "distributed", "secret_env")
    secrets: dict[str, str] = {}
    text_out = text
    env = (raw.get("distributed") or {}).get("env") if isinstance(raw.get("distributed"), dict) else None
    if isinstance(env, dict) and any(is_secret_name(str(k), extra) for k in env):
        for k in [k for k in env if is_secret_name(str(k), extra)]:
            secrets[str(k)] = str(env.pop(k))
        text_out = yaml.safe_dump(raw, sort_keys=False, default_flow_style=False)
    public: list[str] = []
    for item, _, _ in parsed:  # every form of override through the one rule (`config.overrides`)
        kept, hidden = split_secret_override(item, extra)
        secrets.update(hidden)
        if kept is not None:
            public.append(kept)
    return Submission(data=data, text=text_out, overrides=public, secrets=secrets)


def _get_list(data: dict, *keys: str) -> list[str]:
    for k in keys:
        data = data.get(k) if isinstance(data, dict) else None  # type: ignore[assignment]
    return [str(x) for x in data] if isinstance(data, list) else []
