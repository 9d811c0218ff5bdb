"""The form over the YAML: the shipped examples, the model choices, and the form <-> YAML round trip.

The round trip is the CLI's override path: a form field is a dotted config key, and setting it is
`scaletune train config.yaml key=value` (`config.parse_override` on the YAML as `config.yamlfile`
reads it), so the YAML the form writes loads to the same config as the command line with those
overrides. Three fields are the form's own, mapped onto config keys: `method` (full / lora / qlora:
`model.lora` and `model.quantization`), `gradient_accumulation` (`training.global_batch_size` =
micro batch x accumulation x world size) and `data_file` (the data part's "Use this file":
`{path, format}` onto `data.train`, see :func:`data_overrides`). Setting `data.train.format` to
another format than alpaca takes `data.train.template` out (a way to render alpaca records only).
The YAML is written again by PyYAML: its comments and layout do not survive an edit from the form
(its keys' order does).

The examples are the `examples/*.yaml` of the service's working directory (where the Docker image
copies them, and where their relative data paths are read from), else of the source checkout the
package runs from (an editable install): they are not package data, as their data files and
model folders are named relative to the working directory and would not follow them into a wheel.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel

from scaletune.config import DataConfig, ModelConfig, TrainingConfig, parse_override
from scaletune.config.loader import plain_copy
from scaletune.config.overrides import set_path  # the CLI's own key setting
from scaletune.config.yamlfile import parse
from scaletune.serve.jobs.data_formats import FORMATS

METHODS = ("full", "lora", "qlora")
#: The form's fields: dotted config keys, and the two the form maps onto config keys.
FIELDS = (
    "model.name_or_path",
    "method",
    "model.dtype",
    "training.learning_rate",
    "training.epochs",
    "training.max_steps",
    "training.micro_batch_size",
    "gradient_accumulation",
    "training.global_batch_size",
    "data.train.format",
    "data.max_seq_length",
    "data.eval_fraction",
    "training.sample_prompts",
)
#: The keys of `data.train` that describe the source a chosen file replaces, taken out with it: a
#: cap on its records sized for that data (the quickstart's 96 of its two files), the column of its
#: records, the split and subset of a data set name. A file is trained whole unless the person caps it.
SOURCE_KEYS = ("max_samples", "field", "split", "subset")
_BATCH = ("training.micro_batch_size", "training.global_batch_size")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_SECTIONS = {"model": ModelConfig, "training": TrainingConfig, "data": DataConfig}
# How deep and how many folders the model listing walks under each read root: a listing, not a
# search of the disk (a read root may be /tmp or a home folder).
MODEL_DEPTH, MODEL_VISITS = 3, 5000
_SKIP = {".git", ".venv", "venv", "node_modules", "__pycache__", ".cache", "site-packages"}


class FormProblem(ValueError):
    """A request the round trip cannot do: its problems (the API answers 422)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


# -- the round trip ------------------------------------------------------------------------------
def read_yaml(text: str) -> dict:
    """The YAML as the CLI reads a config file (`config.yamlfile`: no duplicate keys, bounded
    aliases and depth), named `config` in its problems.

    Raises:
        FormProblem: the text does not parse, or its top level is not a mapping.
    """
    data, _, problems = parse(text.encode(), "config")
    if problems:
        raise FormProblem(problems)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise FormProblem(["config: the top level must be a mapping of keys"])
    return data


def _get(data: Any, key: str) -> Any:
    for part in key.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _default(key: str) -> Any:
    """The schema's default of a dotted key (through nested sections: `data.train.format`); None
    for a key it does not know or a field without a default."""
    section, *names = key.split(".")
    model = _SECTIONS.get(section)
    for i, name in enumerate(names):
        info = model.model_fields.get(name) if model is not None else None
        if info is None:
            return None
        if i == len(names) - 1:
            if info.is_required():
                return None
            return info.default_factory() if info.default_factory is not None else info.default
        kinds = (info.annotation, *get_args(info.annotation))  # a section, or `Section | None`
        model = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
    return None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def fields_of(data: dict, world_size: int = 1) -> dict[str, Any]:
    """The form's field values of a config mapping (None where the YAML does not set a key)."""
    out = {k: _get(data, k) for k in FIELDS if k not in ("method", "gradient_accumulation")}
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    if model.get("lora") is None:
        out["method"] = "full"
    else:
        out["method"] = "lora" if model.get("quantization") is None else "qlora"
    micro, total = (_int(v if (v := out[k]) is not None else _default(k)) for k in _BATCH)
    step = micro * world_size if micro and micro > 0 else None
    out["gradient_accumulation"] = total // step if step and total and total % step == 0 else None
    return out


def defaults_of(values: dict[str, Any]) -> dict[str, Any]:
    return {k: _default(k) for k, v in values.items() if v is None and "." in k}


def _flow(value: Any) -> str:
    """A value as an override writes it: YAML that reads back as the same value."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True, sort_keys=False)
    return text.removesuffix("...\n").strip()


def overrides_for(data: dict, fields: dict[str, Any], world_size: int = 1) -> tuple[list[str], list[str]]:
    """(`key=value` overrides, keys to remove) that set `fields` on the config mapping `data`.

    Raises:
        FormProblem: an unknown field name, a method other than full / lora / qlora, or a gradient
            accumulation that is not a whole number >= 1.
    """
    problems, out, remove = [], [], []
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    for key, value in fields.items():
        if key == "method":
            if value not in METHODS:
                problems.append(f"method: one of {', '.join(METHODS)}, not {value!r}")
                continue
            lora, quant = model.get("lora"), model.get("quantization")
            if value == "full":
                out.append("model.lora=null")
            elif not isinstance(lora, dict):  # keep adapters already configured
                out.append("model.lora=" + _flow({"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "auto"}))
            if value == "qlora" and not isinstance(quant, dict):
                out.append("model.quantization=" + _flow({"bits": 4, "quant_type": "nf4"}))
            elif value != "qlora" and quant is not None:
                out.append("model.quantization=null")
        elif key == "gradient_accumulation":
            continue  # after the micro batch size it multiplies (below)
        elif key == "data_file" or (key == "data.train.format" and value not in (None, "")):
            found, sets, drops = data_overrides(data, key, value)
            problems += found
            out += sets
            remove += drops
        elif not isinstance(key, str) or not _KEY.fullmatch(key):
            problems.append(f"{str(key)[:80]!r}: not a dotted config key")
        elif value is None or value == "" or value == []:
            remove.append(key)
        else:
            out.append(f"{key}={_flow(value)}")
    if "gradient_accumulation" in fields and fields["gradient_accumulation"] not in (None, ""):
        accum = _int(fields["gradient_accumulation"])
        if accum is None or accum < 1:
            problems.append(f"gradient_accumulation: a whole number >= 1, not {fields['gradient_accumulation']!r}")
        else:
            micro = fields.get("training.micro_batch_size", _get(data, "training.micro_batch_size"))
            micro = _int(micro if micro is not None else _default("training.micro_batch_size"))
            if micro is not None and micro >= 1:  # else the micro batch's own problem is the one to show
                out.append(f"training.global_batch_size={micro * accum * world_size}")
    if problems:
        raise FormProblem(problems)
    return out, remove


def data_overrides(data: dict, key: str, value: Any) -> tuple[list[str], list[str], list[str]]:
    """(problems, overrides, keys to remove) of the form's `data_file` or `data.train.format` on
    the config mapping `data`.

    `data_file` ({path, format}: a file of the data area, and the format its records' keys say,
    or null when they say none) sets `data.train.path` and, when given, `data.train.format`, and
    takes out what described the source it replaces (:data:`SOURCE_KEYS`). Either field, setting a
    format other than alpaca, takes out `data.train.template` (alpaca records' prompt format:
    the schema refuses it with another format). Everything else of the config stays: the model,
    `data.train.template` with alpaca records (a choice for the model, not the data), `data.eval`."""
    train = _get(data, "data.train")
    train = train if isinstance(train, dict) else {}
    out: list[str] = []
    remove: list[str] = []
    fmt = value
    if key == "data_file":
        path = value.get("path") if isinstance(value, dict) else None
        fmt = value.get("format") if isinstance(value, dict) else None
        if not isinstance(path, str) or not path.strip():
            return [f"data_file: {{path, format}} of a data file, not {str(value)[:80]!r}"], [], []
        if fmt is not None and fmt not in FORMATS:
            return [f"data_file.format: one of {', '.join(FORMATS)} or null, not {str(fmt)[:40]!r}"], [], []
        out.append(f"data.train.path={_flow(path)}")
        remove += [f"data.train.{k}" for k in SOURCE_KEYS if k in train]
        if fmt is None:
            return [], out, remove
    out.append(f"data.train.format={_flow(fmt)}")
    if fmt != "alpaca" and "template" in train:
        remove.append("data.train.template")
    return [], out, remove


def apply_fields(text: str, fields: dict[str, Any], world_size: int = 1) -> tuple[str, dict, list[str]]:
    """(the YAML with `fields` set, its mapping, the overrides that make the same config): the
    overrides applied as the CLI applies them (`parse_override`, then the key set), and the keys
    of null fields taken out (listed as `key=<its default>`).

    Raises:
        FormProblem: the YAML does not parse, or a field cannot be set (see :func:`overrides_for`).
    """
    data = plain_copy(read_yaml(text))  # an alias's target is set in one place, as read_config sets it
    overrides, remove = overrides_for(data, fields, world_size)
    for item in overrides:
        try:
            parts, value = parse_override(item)
        except ValueError as exc:
            raise FormProblem([f"{item.split('=', 1)[0]}: {exc}"]) from None
        set_path(data, parts, value)
    for key in remove:
        *parents, last = key.split(".")
        node = _get(data, ".".join(parents)) if parents else data
        if isinstance(node, dict):
            node.pop(last, None)
    out = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True) if data else ""
    # A removed key is its default on the command line.
    return out, data, overrides + [f"{key}={_flow(_default(key))}" for key in remove]


# -- the examples and the models ------------------------------------------------------------------
def examples_dir(workdir: Path) -> Path | None:
    """`examples/` of the working directory, else of the source checkout (None: neither has one)."""
    for root in (workdir, Path(__file__).resolve().parents[4]):
        if (root / "examples").is_dir() and any((root / "examples").glob("*.yaml")):
            return root / "examples"
    return None


def describe(text: str) -> str:
    """An example's description: the comment lines it opens with, as one paragraph."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(x for x in lines if x)


def examples(workdir: Path) -> dict[str, Path]:
    folder = examples_dir(workdir)
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))} if folder else {}


def _roots(policy, workdir: Path) -> list[Path]:
    return [Path(os.path.realpath(r)) for r in (policy.read_roots if policy.read_roots is not None else [workdir])]


def local_models(policy, workdir: Path, jobs_home: Path) -> list[str]:
    """Model folders (a config.json directly inside) the policy lets a job read: under a read root
    (symbolic links resolved, never outside one), at most MODEL_DEPTH levels down, not in the jobs
    folder (another job's files); relative to the working directory when inside it, as typed."""
    from scaletune.serve.edge.policy import inside

    roots, home = _roots(policy, workdir), Path(os.path.realpath(jobs_home))
    found: set[Path] = set()
    visits = 0
    for root in roots:
        level = [root]
        for _ in range(MODEL_DEPTH + 1):
            below = []
            for folder in level:
                visits += 1
                if visits > MODEL_VISITS:
                    break
                real = Path(os.path.realpath(folder))
                if not any(inside(real, r) for r in roots) or inside(real, home):
                    continue
                if (real / "config.json").is_file():
                    found.add(real)
                    continue  # a model folder's own subfolders are not other models
                try:
                    below += [e for e in os.scandir(real) if e.is_dir() and e.name not in _SKIP and e.name[0] != "."]
                except OSError:
                    continue
            level = [Path(e.path) for e in below]
    here = Path(os.path.realpath(workdir))
    return sorted(str(p.relative_to(here)) if inside(p, here) and p != here else str(p) for p in found)
