"""Reading a config: YAML (or a mapping) plus dotted command-line overrides, validated against the
schema, every problem reported at once with its file, line and key; and writing the resolved
config back (`config.yaml`) with secret values redacted.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from scaletune.config.schema import Config
from scaletune.errors import ConfigError


def parse_override(item: str) -> tuple[list[str], Any]:
    """`training.learning_rate=1e-4` -> (["training", "learning_rate"], 1e-4). Values are YAML."""
    if "=" not in item:
        raise ValueError(f"override {item!r} is not of the form key.path=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ValueError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return parts, value


def _set_path(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[parts[-1]] = value


def _key_lines(text: str) -> dict[tuple, int]:
    """Map each key path in a YAML document to its 1-based line (list items by index)."""
    lines: dict[tuple, int] = {}
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                p = path + (k.value,)
                lines[p] = k.start_mark.line + 1
                walk(v, p)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                lines[path + (i,)] = v.start_mark.line + 1
                walk(v, path + (i,))

    if root is not None:
        walk(root, ())
    return lines


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The keys allowed at `loc[:-1]`, walking the pydantic models."""
    cur: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)) or part not in cur.model_fields:
            return []
        cur = _inner_model(cur.model_fields[part].annotation)
    if isinstance(cur, type) and issubclass(cur, BaseModel):
        return list(cur.model_fields)
    return []


def _inner_model(annotation: Any) -> Any:
    for t in getattr(annotation, "__args__", ()) or (annotation,):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
        inner = _inner_model(t) if getattr(t, "__args__", None) else None
        if inner is not None:
            return inner
    return annotation if isinstance(annotation, type) else None


def _format_errors(err: ValidationError, source: str, lines: dict[tuple, int], override_keys: set[tuple]) -> list[str]:
    out = []
    for e in err.errors():
        # Drop the tagged-union / model_validator markers pydantic puts in `loc`.
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        key = ".".join(str(p) for p in loc) or "(top level)"
        where = source
        probe = loc
        while probe and probe not in lines:
            probe = probe[:-1]
        if loc in override_keys or any(loc[: len(k)] == k for k in override_keys):
            where = "command line"
        elif probe in lines:
            where = f"{source}:{lines[probe]}"
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(Config, loc)
            near = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            msg = f"unknown key{hint}; allowed here: {', '.join(allowed)}"
        elif e["type"] == "missing":
            msg = "required key is missing"
        else:
            msg = e["msg"].removeprefix("Value error, ")
        out.append(f"{where}: {key}: {msg}")
    return out


@dataclass
class LoadedConfig:
    """What :func:`read_config` found.

    Attributes:
        config: the validated config, or None when the schema refused it.
        best_effort: the config with every refused key removed (defaults in their place), for the
            cross-field rules to run on so their problems are reported with the schema's; None when
            even that does not validate (a required section is missing).
        problems: the schema's problems, each "file:line: key: message" (or "command line: ...").
        source: the file name (or "<config>").
    """

    config: Config | None
    best_effort: Config | None
    problems: list[str]
    source: str
    lines: dict[tuple, int] = field(default_factory=dict)
    override_keys: set[tuple] = field(default_factory=set)

    def where(self, key: str | None) -> str:
        """`file:line` of a dotted key (or its nearest parent), "command line" for an override's."""
        if key is None:
            return self.source
        loc = tuple(int(p) if p.isdigit() else p for p in key.split("."))
        if loc in self.override_keys or any(loc[: len(k)] == k for k in self.override_keys):
            return "command line"
        probe = loc
        while probe and probe not in self.lines:
            probe = probe[:-1]
        return f"{self.source}:{self.lines[probe]}" if probe in self.lines else self.source


def read_config(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), *, data: dict | None = None
) -> LoadedConfig:
    """Read a YAML config (or a mapping), apply dotted overrides, validate against the schema.

    Never raises for bad input: problems are returned (see :func:`load_config`).

    Args:
        path: the YAML file; relative data and model paths in it stay relative to the working
            directory, as a user types them.
        overrides: `key.path=value` strings; values are parsed as YAML (`1e-4`, `true`, `[a, b]`).
        data: a mapping used instead of reading `path` (tests, the Python API).
    """
    source = str(path) if path is not None else "<config>"
    problems: list[str] = []
    lines: dict[tuple, int] = {}
    if data is None:
        p = Path(path)  # type: ignore[arg-type]
        if not p.is_file():
            return LoadedConfig(None, None, [f"{source}: config file not found"], source)
        text = p.read_text()
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{source}:{mark.line + 1}" if mark else source
            return LoadedConfig(None, None, [f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}"], source)
        lines = _key_lines(text)
    if not isinstance(data, dict):
        return LoadedConfig(None, None, [f"{source}: the top level must be a mapping of keys"], source)
    data = _deepcopy(data)
    override_keys: set[tuple] = set()
    for item in overrides:
        try:
            parts, value = parse_override(item)
        except ValueError as exc:
            problems.append(f"command line: {exc}")
            continue
        _set_path(data, parts, value)
        override_keys.add(tuple(parts))
    cfg = best = None
    try:
        cfg = best = Config.model_validate(data)
    except ValidationError as exc:
        problems += _format_errors(exc, source, lines, override_keys)
        # A model validator runs only once its own fields are valid; validate again with the
        # failing keys removed so those problems are reported now too, not after a fix.
        pruned = _without(data, [e["loc"] for e in exc.errors()])
        try:
            best = Config.model_validate(pruned)
        except ValidationError as again:
            problems += [p for p in _format_errors(again, source, lines, override_keys) if p not in problems]
    if problems:
        cfg = None
    return LoadedConfig(cfg, best, problems, source, lines, override_keys)


def load_config(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), *, data: dict | None = None
) -> Config:
    """:func:`read_config`, raising on its problems. Cross-field rules are not run here: they need
    the resolved run (:func:`scaletune.resolve.resolve`).

    Raises:
        ConfigError: listing every schema problem, each with its file:line (or "command line") and key.
    """
    loaded = read_config(path, overrides, data=data)
    if loaded.problems:
        raise ConfigError(loaded.problems, title="invalid config")
    assert loaded.config is not None
    return loaded.config


def _without(data: dict, locs: list[tuple]) -> dict:
    """A copy of `data` with the keys at `locs` removed (defaults then apply)."""
    out = _deepcopy(data)
    for loc in locs:
        node: Any = out
        for part in loc[:-1]:
            try:
                node = node[part]
            except (KeyError, IndexError, TypeError):
                node = None
                break
        if isinstance(node, dict) and loc and loc[-1] in node:
            del node[loc[-1]]
    return out


def _deepcopy(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _deepcopy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deepcopy(v) for v in x]
    return x


_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|CREDENTIAL", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """True for environment variable names that usually hold credentials (HF_TOKEN, WANDB_API_KEY)."""
    return bool(_SECRET.search(name))


def redacted(cfg: Config) -> dict:
    """The config as plain data with secret-looking `distributed.env` values replaced."""
    data = cfg.model_dump(mode="json")
    env = data["distributed"]["env"]
    for k in env:
        if is_secret_name(k):
            env[k] = "<redacted>"
    return data


def dump_config(cfg: Config) -> str:
    """The fully resolved config as YAML, every default filled in (written as `config.yaml`).

    Values of `distributed.env` whose names look like credentials are redacted.
    """
    return yaml.safe_dump(redacted(cfg), sort_keys=False, default_flow_style=False)
