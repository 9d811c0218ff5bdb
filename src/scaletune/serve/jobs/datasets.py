"""Bring data: the service's data area, where an uploaded file is checked, stored and listed (the
routes that upload and preview are `api/data.py`'s).

The data area is `policy.data_area(jobs folder)` (`<jobs>/data`), made on the first upload. Every
job's config may read it (policy.check), besides the admin's read roots. `POST /api/data?name=F`
takes the file as the raw request body (the page sends the picked `File` as it is: no multipart
parser, no copy in memory): the guard lets this one route through unread, and the route counts
every byte against the policy's `max_upload_bytes` as it streams it to a hidden temporary file
there. The file is then parsed as its suffix says (JSON, JSONL, CSV, Parquet; the JSON ones with
the trainer's own readers) and linked to its name, never over another file: the same name with
other bytes gets a suffix (`x-2.jsonl`), the same bytes again answer the file already there.
The preview is `data_preview.preview`.

The data an "evaluate on a data set" task reads (`api/tasks.py`) is found and checked here before
the task starts (`check_eval_data`): a file of the data area named as `GET /api/data` lists it (what
the page offers), or a local file or folder (the policy's read roots apply, as to a submitted
config's data). A name that is nowhere, a file the service cannot read, or records of another format
than the one evaluated are refused at once, each problem named, instead of a task that loads the
model and then fails."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
from pathlib import Path

from scaletune.errors import UserError
from scaletune.serve.edge.policy import data_area
from scaletune.serve.jobs.data_formats import detect_file

SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
#: Images a vision-language model's records name (`{"type": "image", "path": "0042.png"}`: a file
#: beside the records in the data area): checked at upload as training reads them
#: (`data.sources.read_image`: decoded whole, within Pillow's pixel bound).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
MAX_NAME = 128
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")  # kept out of a stored name: a config names it in plain YAML
META = ".{}.meta.json"  # beside each upload: its record count and digest (dot files are never listed)


def stored_name(raw: str) -> tuple[str | None, str | None]:
    """(the name an upload is stored under, None) or (None, why it is refused). Refused: a path
    (a separator, `..`), a NUL or control character, a dot file, no data or image suffix, over 128
    characters; other characters outside letters, digits and `._+-` become `_`."""
    if not raw or len(raw) > MAX_NAME:
        return None, f"name: 1 to {MAX_NAME} characters, got {len(raw)}"
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in raw):
        return None, "name: contains a NUL or control character"
    if "/" in raw or "\\" in raw or raw in (".", ".."):
        return None, f"name {raw!r}: a file name, not a path (no / or \\)"
    if raw.startswith("."):
        return None, f"name {raw!r}: a dot file is not taken"
    name = _UNSAFE.sub("_", raw)
    if Path(name).suffix.lower() not in SUFFIXES + IMAGE_SUFFIXES or Path(name).stem in ("", "_"):
        return None, (
            f"name {raw!r}: a data file ends with {', '.join(SUFFIXES)}, an image its records name with "
            f"{', '.join(IMAGE_SUFFIXES)}"
        )
    return name, None


def is_image(name: str) -> bool:
    """Whether the data area's file `name` is an image (:data:`IMAGE_SUFFIXES`), not records."""
    return Path(name).suffix.lower() in IMAGE_SUFFIXES


def area_file(home: Path, name: str) -> Path:
    """The uploaded file `name` in the data area.

    Raises:
        UserError: the name is not one an upload is stored under, or no such file is there.
    """
    clean, why = stored_name(name)
    if why or clean != name:
        raise UserError(why or f"file {name!r}: not a name in the data area (see GET /api/data)", title="no such file")
    path = data_area(home) / name
    if not path.is_file():
        raise UserError(
            f"file {name!r}: not in the data area (upload it first; see GET /api/data)", title="no such file"
        )
    return path


def check_file(path: Path, name: str) -> int | None:
    """The number of records of the data file at `path`, read as the suffix of `name` says; None for
    an image, decoded whole as training decodes it.

    Raises:
        DataError: it does not parse: the problems name the file and the line (JSON, JSONL, CSV)
            or the row group (Parquet) where it fails; it holds no record; an image that Pillow
            cannot decode or over its pixel bound (read from the header first: a decompression
            bomb is not decoded).
    """
    from scaletune.data.sources import MAX_IMAGE_PIXELS, jsonl_records, read_image
    from scaletune.errors import DataError

    suffix = Path(name).suffix.lower()
    problems = _Problems(name)
    if is_image(name):
        try:
            read_image(str(path), MAX_IMAGE_PIXELS)
        except ValueError as exc:  # Pillow names the file it read: the upload's temporary one
            raise DataError(f"{name}: {str(exc).replace(str(path), name)}") from None
        return None
    if suffix == ".parquet":
        n = _parquet_rows(path, name)
    elif suffix == ".csv":
        n = _csv_rows(path.read_bytes(), name)
    elif suffix == ".jsonl":
        n = 0
        for where, rec in jsonl_records(path.read_bytes(), name, None, problems):
            n += 1
            if n > MAX_UPLOAD_RECORDS:
                raise _too_many(name)
            if not isinstance(rec, dict):
                problems.append(
                    f"{where.rsplit(': record', 1)[0]}: a record is a JSON object, got {type(rec).__name__}"
                )
    else:
        n = _json_rows(path.read_bytes(), name, problems)
    if problems:
        raise DataError(problems.lines())
    if n == 0:
        raise DataError(f"{name}: no records")
    return n


def _csv_rows(raw: bytes, name: str) -> int:
    from scaletune.errors import DataError

    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{name}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x})") from None
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader, None)
        if not header or any(not h.strip() for h in header) or len(set(header)) != len(header):
            raise DataError(f"{name}:1: the first line names the columns (each once, none empty): {header}")
        n = 0
        for row in reader:
            if not row:
                continue
            n += 1
            if n > MAX_UPLOAD_RECORDS:
                raise _too_many(name)
            if len(row) != len(header):
                raise DataError(
                    f"{name}:{reader.line_num}: row {n} has {len(row)} fields, the header has {len(header)}"
                )
    except csv.Error as exc:
        raise DataError(f"{name}:{reader.line_num}: not valid CSV: {exc}") from None
    return n


def _json_rows(raw: bytes, name: str, problems: list[str]) -> int:
    """The records of a .json upload (a list of objects), decoded one at a time and let go
    (`data.sources.iter_json_list`): the check holds the text and one record, not the list
    (`[{},{},...]` as Python objects is about 50 times its size: a 256 MiB upload would take 12 GB)."""
    from scaletune.data.sources import iter_json_list, json_text

    text = json_text(raw, name)
    del raw
    n = 0
    for record in iter_json_list(text, name):
        n += 1
        if n > MAX_UPLOAD_RECORDS:
            raise _too_many(name)
        if not isinstance(record, dict):
            problems.append(f"{name}: record {n}: a record is a JSON object, got {type(record).__name__}")
    return n


# The most records an upload may hold: its check decodes each (a few microseconds apiece), and 10
# million is 27 bytes a record at the default 256 MiB, shorter than any record worth training on;
# a file of `{}` records would otherwise cost minutes of the service's CPU.
MAX_UPLOAD_RECORDS = 10_000_000


class _Problems(list):
    """An upload's problems: the first SHOWN kept, the others counted (a file of a million bad lines
    would otherwise be a million messages in memory); past MAX_UPLOAD_RECORDS the check stops."""

    SHOWN = 20

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.more = name, 0

    def append(self, problem: str) -> None:
        if len(self) < self.SHOWN:
            super().append(problem)
            return
        self.more += 1
        if self.more > MAX_UPLOAD_RECORDS:
            raise _too_many(self.name)

    def lines(self) -> list[str]:
        return [*self, *([f"... and {self.more:,} more"] if self.more else [])]


def _too_many(name: str) -> Exception:
    from scaletune.errors import DataError

    return DataError(f"{name}: over {MAX_UPLOAD_RECORDS:,} records, the most a data file uploaded here may hold")


# A Parquet upload is checked batch by batch with its text columns kept dictionary-encoded: a
# 68 KB file of one repeated 200-byte string in 3 million rows decodes to 600 MB when read whole
# (the footer's sizes are the encoded ones and do not tell), and pyarrow keeps what it allocated.
PARQUET_CHECK_BATCH = 4096


def _parquet_rows(path: Path, name: str) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from scaletune.errors import DataError

    try:
        schema = pq.read_schema(path)
        texts = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
        texts += [f.name for f in schema if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)]
        pf = pq.ParquetFile(path, read_dictionary=texts)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise DataError(f"{name}: not a Parquet file: {exc}") from None
    if pf.metadata.num_rows > MAX_UPLOAD_RECORDS:
        raise _too_many(name)
    first = 0
    for g in range(pf.num_row_groups):
        rows = pf.metadata.row_group(g).num_rows
        try:
            for _ in pf.iter_batches(batch_size=PARQUET_CHECK_BATCH, row_groups=[g]):
                pass
        except Exception as exc:  # noqa: BLE001
            raise DataError(
                f"{name}: rows {first + 1} to {first + rows} (row group {g + 1}): cannot be read: {exc}"
            ) from None
        first += rows
    return pf.metadata.num_rows


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: Path) -> dict:
    meta = path.with_name(META.format(path.name))
    try:
        info = json.loads(meta.read_text())
    except (OSError, ValueError):
        info = {}
    # The format its first record's keys say (None: no format's); told at upload, else now (a file
    # uploaded before the service recorded it).
    fmt = info["format"] if "format" in info else "image" if is_image(path.name) else detect_file(path)
    return {
        "name": path.name,
        "size": path.stat().st_size,
        "records": info.get("records"),
        "path": str(path),
        "format": fmt,
        "by": info.get("by"),  # the token that uploaded it (None: uploaded before this was recorded)
    }


def listing(home: Path) -> list[dict]:
    """The data area's files (name, size in bytes, records, the path a config names), by name."""
    area = data_area(home)
    if not area.is_dir():
        return []
    return [
        file_entry(p)
        for p in sorted(area.iterdir())
        if not p.name.startswith(".")
        and p.suffix.lower() in SUFFIXES + IMAGE_SUFFIXES
        and p.is_file()
        and not p.is_symlink()
    ]


def place(tmp: Path, name: str, digest: str) -> tuple[Path, bool]:
    """Link the checked upload `tmp` to `name` in its folder, or to `stem-2.suffix`, `-3`, ...
    when that name holds other bytes (a link never replaces a file); (the path, False) when a file
    of that name already holds these bytes (`tmp` is then left for the caller to remove)."""
    stem, suffix = Path(name).stem, Path(name).suffix
    for i in range(1, 1000):
        path = tmp.with_name(name if i == 1 else f"{stem}-{i}{suffix}")
        try:
            os.link(tmp, path)
            return path, True
        except FileExistsError:
            meta = path.with_name(META.format(path.name))
            try:
                known = json.loads(meta.read_text()).get("sha256")
            except (OSError, ValueError):
                known = None
            if (known or _digest(path)) == digest:
                return path, False
    raise UserError(f"name {name!r}: 999 files of this name are there already; rename it", title="upload refused")


# -- the data an evaluation reads --------------------------------------------------------------------
#: Records read by the check (the first ones, by the trainer's reader): enough to meet a file of
#: another format or a broken first line at once; the task reads the whole file.
CHECKED_RECORDS = 1000


def is_area_name(value: str) -> bool:
    """Whether `value` names a file of the data area (a bare name, as GET /api/data lists it) rather
    than a path."""
    return not any(sep in value for sep in ("/", "\\")) and not value.startswith(("~", "."))


def find_eval_data(value: str, home: Path, workdir: Path) -> tuple[Path | None, list[str]]:
    """(the path the task reads, []) or (None, why not). A bare name is the data area's file of that
    name (a file of the service's working directory is `./NAME`, a path); anything else is a path,
    relative to the working directory."""
    if is_area_name(value):
        clean, _ = stored_name(value)
        area = data_area(home) / value
        if clean == value and area.is_file() and not area.is_symlink():
            return area, []
        return None, [
            f"data: {value!r}: no such file in the data area (GET /api/data lists its files; upload it on "
            f"the jobs page's Data part first, or give a path: ./{value} for the service's working directory)"
        ]
    p = Path(os.path.expanduser(value))
    p = p if p.is_absolute() else workdir / p
    if not p.exists():
        return None, [f"data: {value}: no such file or folder on the service's machine"]
    return p, []


def readable(path: Path, value: str) -> list[str]:
    """Why the service's user cannot read `path` ([] when it can)."""
    if path.is_dir():
        ok = os.access(path, os.R_OK | os.X_OK)
    else:
        try:
            with path.open("rb") as f:
                f.read(1)
            ok = True
        except OSError:
            ok = False
    return [] if ok else [f"data: {value}: the service cannot read it (permission denied)"]


def run_format(run_dir: Path) -> str:
    """The format `scaletune eval --data` reads with when none is given: the run's
    `data.train.format` (its config.yaml), else alpaca (`inference.evaluate.eval_data_config`)."""
    from scaletune.config import load_config

    try:
        train = load_config(run_dir / "config.yaml").data.train
    except (UserError, OSError):
        return "alpaca"
    return train.format if train is not None else "alpaca"


def records_refused(path: Path, value: str, fmt: str) -> list[str]:
    """The reader's problems with the first CHECKED_RECORDS records of `path` read as `fmt`: another
    format's records are one line naming the fix (`set format: messages`), a broken line its file and
    line; the path as the request gave it."""
    from scaletune.config import DataSource
    from scaletune.data.sources import load_records

    try:
        load_records(DataSource(path=str(path), format=fmt, max_samples=CHECKED_RECORDS), key="format")  # type: ignore[arg-type]
    except UserError as exc:
        return [f"data: {p.replace(str(path), value)}" for p in exc.problems]
    return []


def check_eval_data(
    value: str, fmt: str | None, run_dir: Path, home: Path, workdir: Path
) -> tuple[Path | None, list[str]]:
    """(the path to evaluate on, []) or (None, every problem): found (:func:`find_eval_data`), readable, and its
    first records of the format evaluated (`fmt`, else the run's)."""
    path, problems = find_eval_data(value, home, workdir)
    if path is None:
        return None, problems
    problems = readable(path, value)
    if not problems:
        problems = records_refused(path, value, fmt or run_format(run_dir))
    return (None, problems) if problems else (path, [])
