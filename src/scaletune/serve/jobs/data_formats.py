"""A data file's format, told from the keys of its first record (`config.starter.detect_format`,
as `scaletune config new` tells it): recorded at upload, listed by `GET /api/data`, and set as
`data.train.format` when the page's "Use this file" chooses the file. (A file read as another
format is refused in one line naming the fix by the reader itself: `data.sources.load_records`.)
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, get_args

from scaletune.config import DataSource
from scaletune.config.starter import detect_format

#: The values `data.train.format` takes, from the schema (the form's select offers these).
FORMATS: tuple[str, ...] = get_args(DataSource.model_fields["format"].annotation)


def first_record(path: Path) -> Any:
    """The first record of a data file as its suffix says: a JSONL file's first line, a JSON list's
    first item (both through the trainer's reader: `data.sources.jsonl_records`, `iter_json_list`,
    which decodes the list one item at a time), a CSV file's columns or a Parquet file's (as the keys
    of a record); None when the file cannot be read so."""
    from scaletune.data.sources import iter_json_list, json_text, jsonl_records

    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            return next((record for _, record in jsonl_records(path.read_bytes(), str(path), 1, [])), None)
        if suffix == ".json":
            return next(iter_json_list(json_text(path.read_bytes(), str(path)), str(path)), None)
        if suffix == ".csv":
            with path.open(newline="", encoding="utf-8-sig") as f:
                header = next(csv.reader(f), None)
            return dict.fromkeys(header, "") if header else None
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return dict.fromkeys(pq.read_schema(path).names)
    except (OSError, ValueError, RecursionError, csv.Error):  # the reader's DataError, Arrow's errors: ValueErrors
        return None
    return None


def detect_file(path: Path) -> str | None:
    """The format whose keys the file's first record has (:data:`config.starter.SIGNATURES`), or None."""
    return detect_format(first_record(path))


__all__ = ["FORMATS", "detect_file", "first_record"]
