"""Reading and checking records: local JSON / JSONL / Parquet / CSV files and Hugging Face data
sets, reduced to the fields of their format, and the deterministic train/eval split."""

from __future__ import annotations

import io
import json
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scaletune.config import DataConfig, DataSource
from scaletune.errors import DataError, Problem, texts

IGNORE_INDEX = -100

# The roles a ``messages`` record may use. Defined here, where records are checked, rather than
# in templates.py, which imports IGNORE_INDEX from this module (no import cycle).
ROLES = ("system", "user", "assistant")
#: `data.max_image_pixels`' default (Pillow's own bound, `PIL.Image.MAX_IMAGE_PIXELS`).
MAX_IMAGE_PIXELS = DataConfig.model_fields["max_image_pixels"].default
_MAX_PROBLEMS = 20


def _cap(problems: list[str]) -> list[str]:
    if len(problems) <= _MAX_PROBLEMS:
        return problems
    return problems[:_MAX_PROBLEMS] + [f"... and {len(problems) - _MAX_PROBLEMS} more"]


def _raise(problems: list[str]) -> None:
    if problems:
        raise DataError(_cap(problems), title="invalid data")


def _required_fields(source: DataSource) -> tuple[str, ...]:
    if source.format == "alpaca":
        return ("instruction", "output")
    if source.format == "messages":
        return (source.field or "messages",)
    return (source.field or "text",)


#: The fields of preference and KTO records (`data.preference`): the prompt, then the completions it pairs.
FIELDS = {"preference": ("prompt", "chosen", "rejected"), "kto": ("prompt", "completion", "label")}


def _turns(value: Any, role: str, where: str, name: str) -> tuple[list[dict] | None, list[str]]:
    """A string as one turn of `role`, a turn object as itself, a list of turns checked."""
    if isinstance(value, str):
        return [{"role": role, "content": value}], []
    items = [value] if isinstance(value, dict) else value
    if not isinstance(items, list) or not items:
        return None, [f"{where}: field '{name}' must be a string or a non-empty list of {{role, content}} objects"]
    out, problems = [], []
    for j, m in enumerate(items):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            problems.append(
                f"{where}: {name}[{j}] must be an object with 'role' (one of {', '.join(ROLES)}) and 'content' (a string)"
            )
            continue
        out.append({"role": m["role"], "content": m["content"]})
    return (None if problems else out), problems


def normalize_preference(record: dict, fmt: str, where: str) -> tuple[dict | None, list[str]]:
    """A `preference` or `kto` record as chat turns (`prompt`: list of turns; completions: lists of
    turns; kto's `label`: bool), or the problems that prevent it."""
    missing = [f"{where}: missing field '{k}' (format {fmt})" for k in FIELDS[fmt] if record.get(k) is None]
    if missing:
        return None, missing
    out: dict[str, Any] = {}
    prompt, problems = _turns(record["prompt"], "user", where, "prompt")
    out["prompt"] = prompt
    for name in FIELDS[fmt][1:]:
        if name == "label":
            if not isinstance(record["label"], bool):
                problems.append(f"{where}: field 'label' must be true (desirable) or false (undesirable)")
            out["label"] = record["label"]
            continue
        turns, bad = _turns(record[name], "assistant", where, name)
        problems += bad
        if turns is not None and turns[-1]["role"] != "assistant":
            problems.append(f"{where}: field '{name}' must end with an assistant turn (the answer that is trained)")
        out[name] = turns
    if fmt == "preference" and not problems and out["chosen"] == out["rejected"]:
        problems.append(f"{where}: 'chosen' and 'rejected' are the same answer")
    return (None if problems else out), problems


def normalize_prompt(record: dict, where: str) -> tuple[dict | None, list[str]]:
    """A `prompt` record (online RL, `data.prompts`) as ``{prompt: turns, fields: the other fields as
    JSON text}``, or the problems that prevent it."""
    if record.get("prompt") is None:
        return None, [f"{where}: missing field 'prompt' (format prompt)"]
    turns, problems = _turns(record["prompt"], "user", where, "prompt")
    if turns is not None and turns[-1]["role"] == "assistant":
        problems.append(f"{where}: field 'prompt' must end with a user turn (the completion is generated after it)")
    fields = {k: v for k, v in record.items() if k != "prompt"}
    try:
        text = json.dumps(fields, ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError):
        text = json.dumps(fields, ensure_ascii=False, sort_keys=True, default=str)
    return (None if problems else {"prompt": turns, "fields": text}), problems


def _normalize(
    record: Any, source: DataSource, where: str, images: Path | None = None, max_pixels: int = MAX_IMAGE_PIXELS
) -> tuple[dict | None, list[str]]:
    """The record reduced to the fields its format uses, or the problems that prevent that.
    `images`: the folder image parts' paths are relative to (a local data file's); `max_pixels`
    the largest image they may name (`data.max_image_pixels`)."""
    if not isinstance(record, dict):
        return None, [f"{where}: expected an object, got {type(record).__name__}"]
    if source.format in ("preference", "kto"):
        return normalize_preference(record, source.format, where)
    if source.format == "prompt":
        return normalize_prompt(record, where)
    problems = []
    for name in _required_fields(source):
        if name not in record or record[name] is None:
            problems.append(f"{where}: missing field '{name}' (format {source.format})")
    if problems:
        return None, problems
    if source.format == "alpaca":
        out = {k: record.get(k) if record.get(k) is not None else "" for k in ("instruction", "input", "output")}
        problems += [f"{where}: field '{k}' must be a string" for k, v in out.items() if not isinstance(v, str)]
        return (None if problems else out), problems
    if source.format == "text":
        name = source.field or "text"
        if not isinstance(record[name], str):
            return None, [f"{where}: field '{name}' must be a string"]
        return {"text": record[name]}, []
    name = source.field or "messages"
    msgs = record[name]
    if not isinstance(msgs, list) or not msgs:
        return None, [f"{where}: field '{name}' must be a non-empty list of {{role, content}} objects"]
    clean = []
    with_images = False
    for j, m in enumerate(msgs):
        if isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), list):
            parts, errs = content_parts(
                m["content"], f"{where}: {name}[{j}].content", images, max_pixels, role=m["role"]
            )
            problems += errs
            with_images = with_images or any(p["type"] == "image" for p in parts)
            clean.append({"role": m["role"], "content": parts})
            continue
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            problems.append(
                f"{where}: {name}[{j}] must be an object with 'role' (one of {', '.join(ROLES)}) "
                "and 'content' (a string, or a list of text and image parts)"
            )
            continue
        clean.append({"role": m["role"], "content": m["content"]})
    if problems:
        return None, problems
    if not with_images:  # text parts alone are the text they hold, as a text model's template reads it
        clean = [{**m, "content": _text_of(m["content"])} for m in clean]
        return {"messages": clean}, []
    # A record with images keeps where it came from: its images are read and checked later, by the
    # model's processor (data.vision), whose problems name the record too.
    return {"messages": clean, "where": where}, []


def _text_of(content: str | list[dict]) -> str:
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def content_parts(
    value: list, where: str, images: Path | None, max_pixels: int, *, role: str
) -> tuple[list[dict], list[str]]:
    """A message's content parts, checked: `{"type": "text", "text": STR}` and `{"type": "image",
    "path": STR}` (not in an assistant's turn), the path relative to `images` (the data file's folder)
    and inside it, never a URL, an image whose header PIL reads and of at most `max_pixels`.
    Returns (the parts, image paths made absolute; the problems, each naming `where` and the part)."""
    parts: list[dict] = []
    problems: list[str] = []
    if not value:
        return parts, [f"{where}: an empty list of parts"]
    for k, part in enumerate(value):
        at = f"{where}[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image" and role == "assistant":
            problems.append(f"{at}: an image in an assistant turn (the model answers in text; images go in user turns)")
        elif kind == "image":
            path, problem = _image_path(part.get("path"), at, images, max_pixels)
            if problem:
                problems.append(problem)
            else:
                parts.append({"type": "image", "path": path})
        else:
            problems.append(f'{at}: a part is {{"type": "text", "text": ...}} or {{"type": "image", "path": ...}}')
    return parts, problems


def read_image(path: str, max_pixels: int, *, decode: bool = True) -> Any:
    """The image at `path` (PIL), decoded as RGB; with `decode` False only its header is read.

    Raises:
        ValueError: not an image PIL reads, truncated or corrupt, or larger than `max_pixels`
            (width x height, from the header: a decompression bomb is refused before decoding).
    """
    import warnings

    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                width, height = img.size
                if width * height > max_pixels:
                    raise ValueError(
                        f"{width}x{height} = {width * height:,} pixels, more than data.max_image_pixels {max_pixels:,}"
                    )
                if not decode:
                    return img
                img.load()
                return img.convert("RGB")
    except (OSError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ValueError(f"not a readable image: {exc}") from None


def _image_path(value: Any, at: str, images: Path | None, max_pixels: int) -> tuple[str, str | None]:
    """(the absolute path of an image part's `path`, or the problem with it: the path, or the
    image's header and size)."""
    if not isinstance(value, str) or not value:
        return "", f'{at}: an image part needs "path", a file relative to the data file'
    if "://" in value or value.startswith("data:"):
        return "", f"{at}: image {value!r} is a URL; images are local files beside the data (none is downloaded)"
    if images is None:
        return (
            "",
            f"{at}: image {value!r}: images are read relative to a local data file's folder, and this data has none",
        )
    path = (images / value).resolve()
    if not path.is_relative_to(images.resolve()):
        return "", f"{at}: image {value!r} is outside the data file's folder {images}"
    if not path.is_file():
        return "", f"{at}: image {value!r} not found (looked at {path})"
    try:
        read_image(str(path), max_pixels, decode=False)
    except ValueError as exc:
        return "", f"{at}: image {value!r}: {exc}"
    return str(path), None


def _looks_local(path: str) -> bool:
    return path.startswith((".", "/", "~")) or Path(path).suffix.lower() in (".json", ".jsonl", ".parquet", ".csv")


def load_records(source: DataSource, key: str = "format", *, max_pixels: int = MAX_IMAGE_PIXELS) -> list[dict]:
    """Read and check the records of one data source.

    Accepts a local ``.json`` file (a list of objects), a ``.jsonl`` file (one object per line), a
    ``.parquet`` / ``.csv`` file, or a local folder / Hugging Face data set name, read with
    ``datasets.load_dataset(path, subset, split=split)``; or a list of local files, concatenated.

    Returns:
        At most ``source.max_samples`` records (the first ones), each reduced to the fields of its
        format: ``{instruction, input, output}`` (``input`` defaults to ""), ``{messages}`` or ``{text}``.

    `key`: how the fix names the source's format key (`data.train.format`) when the records are of
    another format (:func:`_other_format`). `max_pixels`: `data.max_image_pixels`, the largest image
    a `messages` record's image part may name (each image's header is read here).

    Raises:
        DataError: the path does not exist (named); a JSONL line is not valid JSON (file:line); a
            record lacks a required field or has the wrong type (file, record number counted from
            1, line for JSONL, the field). All problems are reported at once, the first 20 listed;
            records that lack the format's fields because the file holds another format are one
            line naming it.
    """
    if isinstance(source.path, list):
        return _load_files(source, max_pixels)
    path = os.path.expanduser(source.path)
    limit = source.max_samples
    problems: list[str] = []
    records: list[dict] = []
    first: list[Any] = []

    def add(record: Any, where: str) -> None:
        if not first:
            first.append(record)
        norm, errs = _normalize(record, source, where, images, max_pixels)
        problems.extend(errs)
        if norm is not None:
            records.append(norm)

    p = Path(path)
    suffix = p.suffix.lower()
    images = p.parent if p.is_file() else p if p.is_dir() else None
    if p.is_file() and suffix in (".jsonl", ".json"):
        try:
            raw = p.read_bytes()
        except OSError as exc:
            raise DataError(f"{path}: cannot be read: {exc.strerror or exc}", title="invalid data") from None
        if suffix == ".jsonl":
            for where, record in jsonl_records(raw, path, limit, problems):
                add(record, where)
        else:
            for i, record in enumerate(json_records(raw, path, limit), 1):
                add(record, f"{path}: record {i}")
    elif p.is_file() and suffix not in (".parquet", ".csv"):
        raise DataError(
            f"{path}: unsupported file type {suffix or '(none)'}; use .json, .jsonl, .parquet or .csv, "
            "a folder, or a Hugging Face data set name",
            title="invalid data",
        )
    elif not p.exists() and _looks_local(source.path):
        raise DataError(f"{path}: data file not found (looked at {p.resolve()})", title="invalid data")
    else:
        for i, record in enumerate(_load_hf(source, path), 1):
            add(record, f"{path} [{source.split}]: record {i}")
    _raise(_other_format(problems, source, first[0] if first else None, path, key))
    if not records:
        raise DataError(f"{path}: no records", title="invalid data")
    return records


def _other_format(problems: list[str], source: DataSource, first: Any, path: str, key: str) -> list[str]:
    """`problems` with the "missing field" lines of `source.format` replaced by one line naming the
    fix, when the first record has the keys of another format (`config.starter.detect_format`): a
    chat JSONL read as alpaca was 20 lines of "missing field 'instruction'" and a count, none
    naming `format: messages` (issue 39). The records' other problems, if any, follow."""
    from scaletune.config.starter import SIGNATURES, detect_format

    detected = detect_format(first)
    suffix = f"(format {source.format})"
    missing = [p for p in problems if ": missing field '" in p and p.endswith(suffix)]
    if detected is None or detected == source.format or not missing:
        return problems
    has = ", ".join(f"'{k}'" for k in dict(SIGNATURES)[detected])
    lacks = " or ".join(dict.fromkeys(p.rsplit(": missing field ", 1)[1].removesuffix(suffix).strip() for p in missing))
    fix = (
        f"{path}: the records have {has}, the fields of format {detected}, not {lacks} "
        f"(format {source.format}): set {key}: {detected}"
    )
    folded = set(missing)
    return [fix, *(p for p in problems if p not in folded)]


def jsonl_records(raw: bytes, path: str, limit: int | None, problems: list[str]) -> Iterator[tuple[str, Any]]:
    """("file:line: record n", record) of each non-empty line (n counts them); an undecodable or
    invalid line becomes a problem, in line order with the records' own."""
    n = 0
    # Line by line (not raw.split, which would hold every line at once: 128 million one-byte lines
    # of a 256 MiB file are 4 GB of bytes objects).
    for lineno, line in enumerate(io.BytesIO(raw), 1):
        if limit is not None and n >= limit:
            break
        if not line.strip():
            continue
        n += 1
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            problems.append(f"{path}:{lineno}: not UTF-8 text (byte 0x{line[exc.start]:02x} at column {exc.start + 1})")
        except json.JSONDecodeError as exc:
            problems.append(f"{path}:{lineno}: not valid JSON: {exc.msg} (column {exc.colno})")
        except RecursionError:
            problems.append(f"{path}:{lineno}: JSON nested too deeply")
        else:
            yield f"{path}:{lineno}: record {n}", record


def json_records(raw: bytes, path: str, limit: int | None) -> list[Any]:
    """The records of a .json file holding a list (the first `limit` of them).

    Without a limit the list is decoded whole (json's C decoder, the fastest); with one, record by
    record (:func:`iter_json_list`), every record read (a broken file is refused either way) and
    only the first `limit` kept, so a preview of a file's first records never holds the rest (a
    list of 10 million `{}` is 30 MB of text and 700 MB as Python objects).

    Raises:
        DataError: not UTF-8, not JSON, or not a list (with the line where it can be told).
    """
    text = json_text(raw, path)
    if limit:
        out = []
        for record in iter_json_list(text, path):  # the rest is read too (a broken file is refused), not kept
            if len(out) < limit:
                out.append(record)
        return out
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise _not_json(path, exc) from None
    if not isinstance(data, list):
        raise DataError(_NOT_A_LIST.format(path=path), title="invalid data")
    return data


_NOT_A_LIST = "{path}: a .json data file must hold a list of records (use .jsonl for one record per line)"
_WHITESPACE = re.compile(r"[ \t\n\r]*")


def json_text(raw: bytes, path: str) -> str:
    """`raw` decoded as UTF-8.

    Raises:
        DataError: it is not UTF-8 (naming the line and the byte).
    """
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x})", title="invalid data") from None


def _not_json(path: str, exc: json.JSONDecodeError | RecursionError) -> DataError:
    """The message of text json cannot decode: its line and column, or its nesting."""
    if isinstance(exc, RecursionError):
        return DataError(f"{path}: JSON nested too deeply", title="invalid data")
    return DataError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg} (column {exc.colno})", title="invalid data")


def iter_json_list(text: str, path: str) -> Iterator[Any]:
    """The items of the JSON list `text`, decoded one at a time (a caller that lets each go holds
    the text and one item). Errors as :func:`json_records`' (the file's line where it can be told)."""
    decoder, ws = json.JSONDecoder(), _WHITESPACE

    def bad(at: int, what: str) -> DataError:
        return DataError(f"{path}:{text.count(chr(10), 0, at) + 1}: not valid JSON: {what}", title="invalid data")

    at = ws.match(text, 0).end()
    if not text.startswith("[", at):
        try:
            json.loads(text)  # its own message for what is not JSON at all
        except (json.JSONDecodeError, RecursionError) as exc:
            raise _not_json(path, exc) from None
        raise DataError(_NOT_A_LIST.format(path=path), title="invalid data")
    at = ws.match(text, at + 1).end()
    if text.startswith("]", at):
        return
    n = 0
    while True:
        try:
            item, at = decoder.raw_decode(text, at)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise _not_json(path, exc) from None
        n += 1
        yield item
        at = ws.match(text, at).end()
        if text.startswith("]", at):
            if ws.match(text, at + 1).end() != len(text):
                raise bad(at, "extra data after the list")
            return
        if not text.startswith(",", at):
            raise bad(at, f"expected ',' or ']' after record {n}")
        at = ws.match(text, at + 1).end()


def _load_files(source: DataSource, max_pixels: int = MAX_IMAGE_PIXELS) -> list[dict]:
    """The records of a list of local files, in order, as one source (at most `max_samples`)."""
    assert isinstance(source.path, list)
    records: list[dict] = []
    problems: list[str] = []
    for path in source.path:
        if not _looks_local(path) and not Path(path).expanduser().exists():
            problems.append(f"{path}: a list of paths holds local files only (use one source for a data set name)")
            continue
        try:
            records += load_records(
                source.model_copy(update={"path": path, "max_samples": None}), max_pixels=max_pixels
            )
        except DataError as exc:
            problems += exc.problems
    _raise(problems)
    return records[: source.max_samples] if source.max_samples else records


def _builder_names() -> set[str]:
    """The `datasets` packaged builders (json, csv, text, parquet, arrow, imagefolder, ...)."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES  # no public list of them

    return set(_PACKAGED_DATASETS_MODULES)


def _load_hf(source: DataSource, path: str) -> list[dict]:
    import datasets

    if not Path(path).exists() and path.lower() in _builder_names():
        # load_dataset("text") builds from every *train* / *test* file under the working
        # directory: files the config never named (past a service's read roots).
        raise DataError(
            f"{path}: names a datasets builder, not a data file, folder or Hub data set; "
            "give the path of the file or folder to read",
            title="invalid data",
        )
    try:
        if Path(path).is_file():
            builder = Path(path).suffix.lower().lstrip(".")
            ds = datasets.load_dataset(builder, data_files=path, split="train")
        else:
            ds = datasets.load_dataset(path, source.subset, split=source.split)
    except Exception as exc:  # noqa: BLE001 - load_dataset raises many types; the user needs the message
        kind = "local folder" if Path(path).is_dir() else "not a local file or folder, so tried as a data set name;"
        msg = f"{path}: {kind} datasets.load_dataset failed: {type(exc).__name__}: {exc}"
        raise DataError(msg, title="invalid data") from None
    if source.max_samples is not None:
        ds = ds.select(range(min(source.max_samples, len(ds))))
    return ds.to_list()


def validate_data(data_cfg: DataConfig) -> None:
    """Read and check every source (train, eval) without tokenizing. Cheap enough to call before
    anything is written to the run directory. ``data.train`` is not read when ``data.dummy`` replaces it.

    Raises:
        DataError: one error listing the problems of all sources, each prefixed ``data.train`` or
            ``data.eval``; also when ``eval_fraction`` would leave train or eval empty.
    """
    problems: list[str] = []
    n_train = data_cfg.dummy.num_samples if data_cfg.dummy is not None else None
    train = data_cfg.train if data_cfg.dummy is None else None
    for key, source in (("train", train), ("eval", data_cfg.eval)):
        if source is None:
            continue
        try:
            n = len(load_records(source, f"data.{key}.format", max_pixels=data_cfg.max_image_pixels))
        except DataError as exc:
            problems += [f"data.{key}: {p}" for p in exc.problems]
            continue
        if key == "train":
            n_train = n
    if n_train is not None and data_cfg.eval_fraction is not None:
        try:
            _split_sizes(n_train, data_cfg.eval_fraction)
        except DataError as exc:
            problems += exc.problems
    if data_cfg.chat_template is not None:
        problems += texts(template_problems(data_cfg.chat_template))
    if problems:
        raise DataError(problems, title="invalid data")


def template_problems(template: str) -> list[Problem]:
    """A chat template must parse as Jinja (in the sandbox transformers renders it in)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        return [Problem("chat template", None, f"data.chat_template: line {exc.lineno} of the template: {exc.message}")]
    return []


def _split_sizes(n: int, fraction: float) -> tuple[int, int]:
    n_eval = max(1, round(n * fraction))
    if n - n_eval < 1:
        raise DataError(f"data.eval_fraction {fraction} of {n} records leaves no training record", title="invalid data")
    return n - n_eval, n_eval


def split_records(records: list, fraction: float, seed: int) -> tuple[list, list]:
    """Deterministic train/eval split: ``round(len * fraction)`` (at least 1) records chosen by a
    ``random.Random(seed)`` permutation go to eval; both parts keep the original order."""
    _, n_eval = _split_sizes(len(records), fraction)
    chosen = set(random.Random(seed).sample(range(len(records)), n_eval))
    train = [r for i, r in enumerate(records) if i not in chosen]
    evl = [r for i, r in enumerate(records) if i in chosen]
    return train, evl
