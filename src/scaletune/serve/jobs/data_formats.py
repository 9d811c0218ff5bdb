"""A data file's format, told from the keys of its first record (`config.starter.detect_format`,
as `scaletune config new` tells it): recorded at upload, listed by `GET /api/data`, and set as
`data.train.format` when the page's "Use this file" chooses the file. (A file read as another
format is refused in one line naming the fix by the reader itself: `data.sources.load_records`.)
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, get_args

from scaletune.config import DataSource
from scaletune.config.starter import detect_format

#: The values `data.train.format` takes, from the schema (the form's select offers these).
FORMATS: tuple[str, ...] = get_args(DataSource.model_fields["format"].annotation)
#: Bytes of a .json file read to find its first record; a longer first record reads the whole file.
PEEK_BYTES = 1 << 20


def first_record(path: Path) -> Any:
    """The first record of a data file as its suffix says: a JSONL file's first line, a JSON list's
    first item, a CSV file's columns or a Parquet file's (as the keys of a record); None when the
    file cannot be read so."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            with path.open("rb") as f:
                line = next((x for x in f if x.strip()), None)
            return json.loads(line) if line is not None else None
        if suffix == ".json":
            return _first_of_list(path)
        if suffix == ".csv":
            with path.open(newline="", encoding="utf-8-sig") as f:
                header = next(csv.reader(f), None)
            return dict.fromkeys(header, "") if header else None
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return dict.fromkeys(pq.read_schema(path).names)
    except (OSError, ValueError, RecursionError, csv.Error):  # JSON, UTF-8 and Arrow errors are ValueErrors
        return None
    return None


def _first_of_list(path: Path) -> Any:
    with path.open("rb") as f:
        head = f.read(PEEK_BYTES)
        whole = not f.read(1)
    for text in [head.decode("utf-8", errors="replace")] + ([] if whole else [path.read_text("utf-8")]):
        at = len(text) - len(text.lstrip())
        if not text.startswith("[", at):
            return None
        rest = text[at + 1 :]
        try:
            return json.JSONDecoder().raw_decode(rest, len(rest) - len(rest.lstrip()))[0]
        except json.JSONDecodeError:
            continue  # cut inside the first record: read the whole file
    return None


def detect_file(path: Path) -> str | None:
    """The format whose keys the file's first record has (:data:`config.starter.SIGNATURES`), or None."""
    return detect_format(first_record(path))


__all__ = ["FORMATS", "detect_file", "first_record"]
