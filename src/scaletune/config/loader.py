"""Reading a config: YAML (or a mapping) plus dotted command-line overrides, validated against the
schema, every problem reported at once with its file, line and key; and writing the resolved
config back (`config.yaml`) with secret values redacted.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from scaletune.config import yamlfile
from scaletune.config.overrides import parse_override, set_path
from scaletune.config.schema import Config
from scaletune.config.secrets import redacted_env
from scaletune.errors import ConfigError


def _where(source: str, lines: dict[tuple, int], loc: tuple, override_keys: set[tuple] = frozenset()) -> str:
    """Where a key path comes from: "command line" when an override set it (or set a key below it,
    as `bogus.x=1` makes an unknown `bogus`), else `file:line` of it or its nearest parent."""
    if any(loc[: len(k)] == k or k[: len(loc)] == loc for k in override_keys if loc):
        return "command line"
    probe = loc
    while probe and probe not in lines:
        probe = probe[:-1]
    return f"{source}:{lines[probe]}" if probe in lines else source


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


def _errors(err: ValidationError) -> list[tuple[tuple, str, str]]:
    """(location, pydantic's error type, message) of each error, the location without the
    tagged-union / model_validator markers pydantic puts in it."""
    out = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        out.append((loc, e["type"], e["msg"].removeprefix("Value error, ")))
    return out


def error_messages(err: ValidationError, prefix: str = "") -> list[str]:
    """THE text of a pydantic error outside a config file: `prefix.key: message` per error
    (`prefix` names what was validated: `lora`, `quantization`, a file)."""
    head = f"{prefix}." if prefix else ""
    return [f"{head}{'.'.join(str(p) for p in loc) or '(top level)'}: {msg}" for loc, _, msg in _errors(err)]


def _format_errors(err: ValidationError, source: str, lines: dict[tuple, int], override_keys: set[tuple]) -> list[str]:
    out = []
    for loc, kind, msg in _errors(err):
        key = ".".join(str(p) for p in loc) or "(top level)"
        where = _where(source, lines, loc, override_keys)
        if kind == "extra_forbidden":
            allowed = _allowed_keys(Config, loc)
            near = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            msg = f"unknown key{hint}; allowed here: {', '.join(allowed)}"
        elif kind == "missing":
            msg = "required key is missing"
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
        return _where(self.source, self.lines, loc, self.override_keys)


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
        try:
            raw = p.read_bytes()
        except OSError as exc:
            return LoadedConfig(None, None, [f"{source}: cannot be read: {exc.strerror or exc}"], source)
        data, lines, problems = yamlfile.parse(raw, source)
        if problems:
            return LoadedConfig(None, None, problems, source, lines)
        data = {} if data is None else data
    if not isinstance(data, dict):
        return LoadedConfig(None, None, [f"{source}: the top level must be a mapping of keys"], source)
    data = plain_copy(data)
    override_keys: set[tuple] = set()
    for item in overrides:
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in item):
            key = item.split("=", 1)[0] if "=" in item else "an override"
            problems.append(f"command line: {key}: contains a control character (newline, escape, ...): refused")
            continue
        try:
            parts, value = parse_override(item)
        except ValueError as exc:
            problems.append(f"command line: {exc}")
            continue
        set_path(data, parts, value)
        override_keys.add(tuple(parts))
    for loc, what in yamlfile.control_characters(data):
        problems.append(f"{_where(source, lines, loc, override_keys)}: {'.'.join(map(str, loc))}: {what}")
    cfg = best = None
    try:
        cfg = best = Config.model_validate(data)
    except ValidationError as exc:
        problems += _format_errors(exc, source, lines, override_keys)
        # A model validator runs only once its own fields are valid; validate again with the
        # failing keys removed so those problems are reported now too, not after a fix.
        refused = [e["loc"] for e in exc.errors()]
        pruned = _without(data, refused)
        try:
            best = Config.model_validate(pruned)
        except ValidationError as again:
            # Not the echo of a removal: "give data.train ..." where data.train was given and refused.
            echoes = tuple(".".join(map(str, loc)) for loc in refused if loc)
            problems += [
                p
                for p in _format_errors(again, source, lines, override_keys)
                if p not in problems and not any(f"give {name} " in p for name in echoes)
            ]
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
    out = plain_copy(data)
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


def plain_copy(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: plain_copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [plain_copy(v) for v in x]
    return x


def redacted(cfg: Config) -> dict:
    """The config as plain data with the secret `distributed.env` values replaced."""
    data = cfg.model_dump(mode="json")
    d = data["distributed"]
    d["env"] = redacted_env(d["env"], d.get("secret_env", ()))
    return data


def dump_config(cfg: Config) -> str:
    """The fully resolved config as YAML, every default filled in (written as `config.yaml`), with
    secret `distributed.env` values redacted (:mod:`scaletune.config.secrets`). A data source's
    `template` is shown for `format: alpaca` only: other formats have their own and ignore it."""
    return yaml.safe_dump(_without_unused_templates(redacted(cfg)), sort_keys=False, default_flow_style=False)


def _without_unused_templates(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _without_unused_templates(v) for k, v in node.items()}
        if "format" in out and "path" in out and out.get("format") != "alpaca":
            out.pop("template", None)
        return out
    if isinstance(node, list):
        return [_without_unused_templates(v) for v in node]
    return node
