"""The data preview of the serve page: an uploaded file's records as training sees them.

Nothing here renders or masks on its own: the records are read by the trainer's reader
(`data.sources.load_records`), tokenized and masked by the encoder `data.build.build_datasets`
uses (`data.build.sft_encoder`: the Alpaca prompt or the chat template, the eos, the assistant
spans), and cut at max_seq_length by the same `cut` training applies. The tokenizer is the config
model's (`models.load_tokenizer`, never with remote code), after the policy allowed its folder.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from scaletune.errors import UserError
from scaletune.serve.jobs.datasets import file_entry

#: Records tokenized for the histogram and the counts (the first ones), at most; batches stop
#: once BUDGET_S have passed (a chat template renders ~500 records a second on a busy CPU), so a
#: click answers in seconds. The answer says how many were measured (`measured`).
MEASURED = 5000
BUDGET_S = 5.0
BINS = 20
_BATCH = 256
_VISION_BATCH = 16  # records with images rendered at once (each image decoded and processed)
_DATA_KEYS = ("max_seq_length", "chat_template")  # what of `data` shapes a record's tokens
_SFT = ("alpaca", "messages", "text")


_LOADING = threading.Lock()  # see `preview`
# Previews running at once, service-wide (api/data.py takes a slot or answers 503): each holds a
# request thread for up to its chat template's render bound (data/render.py SECONDS).
PREVIEW_SLOTS = threading.BoundedSemaphore(2)


def _sections(config: str, max_depth: int) -> tuple[dict, dict]:
    """(model, data) of the config text, parsed as a submission is (nesting bounded)."""
    from scaletune.serve.jobs import submission

    data = submission.read(config, [], max_depth).data
    model, section = data.get("model"), data.get("data")
    problems = []
    if not isinstance(model, dict) or not (model.get("name_or_path") or model.get("tokenizer")):
        problems.append("model.name_or_path: the preview needs the model (its tokenizer): set model.name_or_path")
    if section is not None and not isinstance(section, dict):
        problems.append("data: a mapping (data.train, data.max_seq_length, ...)")
    if problems:
        raise UserError(problems, title="cannot preview")
    return model, section or {}


def _configs(model: dict, section: dict, path: Path) -> tuple[Any, Any]:
    """(ModelConfig, DataConfig) with `data.train.path` set to the uploaded file."""
    from scaletune.config import DataConfig, ModelConfig
    from scaletune.config.loader import error_messages

    problems = []
    if model.get("trust_remote_code"):
        problems.append("model.trust_remote_code: the preview runs no code from a model folder; set it false here")
    if section.get("factory") is not None:
        problems.append("data.factory: a data factory's records are not previewed (the preview reads data.train)")
    train = section.get("train")
    train = dict(train) if isinstance(train, dict) else {}
    # The preview measures the file's first MEASURED records, not a run's first N; only those are
    # read into memory (the whole count is the upload check's, beside the file).
    train["max_samples"] = MEASURED
    train["path"] = str(path)
    if train.get("format", "alpaca") not in _SFT:
        problems.append(f"data.train.format: {train.get('format')}: the preview shows {', '.join(_SFT)} records")
    keep = {k: section[k] for k in _DATA_KEYS if k in section}
    m = d = None
    try:
        m = ModelConfig.model_validate({k: v for k, v in model.items() if k != "trust_remote_code"})
    except ValidationError as exc:
        problems += error_messages(exc, "model")
    try:
        d = DataConfig.model_validate({**keep, "train": train})
    except ValidationError as exc:
        problems += error_messages(exc, "data")
    if problems:
        raise UserError(problems, title="cannot preview")
    return m, d


def _allowed(svc, model: dict) -> None:
    """The policy's rules on the model and tokenizer paths, as a submitted job's."""
    from scaletune.serve.edge import policy as P

    places = P.Places(svc.home, svc.home / ".preview", svc.db_file, [], svc.workdir)
    reads = {k: model[k] for k in ("name_or_path", "tokenizer") if model.get(k) is not None}
    problems, _ = P.check({"model": reads}, svc.policy, places)
    if problems:
        raise UserError(problems, title="refused by this service's policy")


def _batches(records: list[dict]):
    for i in range(0, len(records), _BATCH):
        chunk = records[i : i + _BATCH]
        yield i, {k: [r[k] for r in chunk] for k in chunk[0]}


def _spans(tok, ids: list[int], mask: list[bool]) -> list[dict]:
    """The text of each run of trained or untrained tokens, decoded as a run (a character split
    over tokens stays whole inside a run)."""
    out: list[dict] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = tok.decode(ids[start:i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            out.append({"text": text, "trained": mask[start]})
            start = i
    return out


def histogram(lengths: list[int], max_len: int) -> dict:
    """`BINS` equal bins of token lengths from 0 to the longer of the longest record and max_len."""
    top = max([*lengths, max_len])
    width = max(1, math.ceil((top + 1) / BINS))
    counts = [0] * BINS
    for n in lengths:
        counts[min(n // width, BINS - 1)] += 1
    return {"width": width, "counts": counts, "max_seq_length": max_len, "longest": max(lengths, default=0)}


def preview(svc, path: Path, config: str, n: int) -> dict:
    """The preview of the data file `path` under `config` (see the route's docstring).

    Raises:
        UserError: every problem of the config (each naming its key), the policy, the tokenizer
            (`models.load_tokenizer`'s) or the records (`load_records`', naming file and record).
    """
    from scaletune.serve.jobs.datasets import is_image

    model, section = _sections(config, svc.policy.max_depth)
    mcfg, dcfg = _configs(model, section, path)
    _allowed(svc, model)
    if is_image(path.name):
        raise UserError(f"{path.name}: an image; preview the records that name it", title="cannot preview")
    safe = mcfg.model_copy(update={"trust_remote_code": False})
    # One at a time: the first previews import transformers (and a tokenizer's class, lazily) from
    # several request threads at once, and a module half-imported by one thread is an ImportError
    # in another (12 concurrent first previews gave 11 x 500). Loading a tokenizer is the slow part.
    with _LOADING:
        import jinja2

        from scaletune.data.build import sft_encoder
        from scaletune.data.sources import load_records
        from scaletune.models import load_tokenizer
        from scaletune.models.loading import model_processor

        processor = model_processor(safe) if safe.name_or_path else None
        tok = processor.tokenizer if processor is not None else load_tokenizer(safe)
    if processor is not None:
        return _vision_preview(path, dcfg, processor, n)
    source = dcfg.train
    records = load_records(source, "data.train.format")
    measured = records[:MEASURED]
    encoder = sft_encoder(source, dcfg, tok)
    pairs: list[tuple[list[int], list[int]]] = []
    start = time.monotonic()
    for first, batch in _batches(measured):
        if pairs and time.monotonic() - start > BUDGET_S:
            break
        try:
            pairs += encoder.pairs(batch)
        except jinja2.TemplateError as exc:
            raise UserError(
                f"data.chat_template (else the tokenizer's): the chat template fails on a record from "
                f"record {first + 1} on: {exc}",
                title="cannot preview",
            ) from None
    max_len = dcfg.max_seq_length
    cuts = [encoder.cut(ids, labels) for ids, labels in pairs]
    shown = []
    for i, ((ids, _), cut) in enumerate(zip(pairs[:n], cuts)):
        kept, labels = (cut[0], cut[1]) if cut is not None else (ids[:max_len], [])
        mask = [x != -100 for x in labels] if cut is not None else [False] * len(kept)
        shown.append(
            {
                "index": i + 1,
                "tokens": len(ids),
                "kept": len(kept),
                "truncated": len(ids) > max_len,
                "dropped": cut is None,
                "input_ids": kept,
                "trained": [int(x) for x in mask],
                "spans": _spans(tok, kept, mask),
            }
        )
    lengths = [len(ids) for ids, _ in pairs]
    return {
        "file": path.name,
        "path": str(path),
        "format": source.format,
        "template": "chat template" if encoder.template else ("alpaca prompt" if source.format == "alpaca" else "text"),
        "max_seq_length": max_len,
        "records_total": file_entry(path)["records"] or len(records),
        "measured": len(pairs),
        "records": shown,
        "histogram": histogram(lengths, max_len),
        "truncated": sum(1 for c in cuts if c is not None and c[2]),
        "dropped": sum(1 for c in cuts if c is None),
        "over_max_seq_length": sum(1 for n_ in lengths if n_ > max_len),
    }


#: The longer side of a record's image as the preview shows it, in pixels.
THUMBNAIL = 96


def thumbnail(path: str, max_pixels: int) -> str:
    """The image at `path` (read as training reads it) scaled to at most THUMBNAIL pixels a side, as
    a PNG `data:` URL."""
    import base64
    import io

    from scaletune.data.sources import read_image

    image = read_image(path, max_pixels)
    image.thumbnail((THUMBNAIL, THUMBNAIL))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _vision_preview(path: Path, dcfg: Any, processor: Any, n: int) -> dict:
    """The preview of a vision-language model's chat records: rendered by `data.build.vision_rows`
    (the processor's chat template, image processor and tokenizer; the image tokens never trained),
    each shown record with its images' thumbnails. Records are measured in batches until BUDGET_S
    have passed, as the text preview's."""
    from scaletune.data.build import vision_rows
    from scaletune.data.sources import load_records
    from scaletune.data.vision import as_parts, image_paths

    source = dcfg.train
    if source.format != "messages":
        raise UserError(
            f"data.train.format: {source.format}: a vision-language model trains on format messages",
            title="cannot preview",
        )
    records = load_records(source, "data.train.format", max_pixels=dcfg.max_image_pixels)[:MEASURED]
    tok, max_len = processor.tokenizer, dcfg.max_seq_length
    shown, lengths, dropped = [], [], 0
    start = time.monotonic()
    for first in range(0, len(records), _VISION_BATCH):
        if lengths and time.monotonic() - start > BUDGET_S:
            break
        chunk = records[first : first + _VISION_BATCH]
        rows, counts = vision_rows(chunk, dcfg, processor, "data.train")
        lengths += rows.lengths
        dropped += counts["dropped_empty"]
        kept = {id(r): i for i, r in enumerate(rows.records)}
        for j, record in enumerate(chunk[: max(0, n - len(shown))]):
            i = kept.get(id(record))
            row = rows[i] if i is not None else rows.row(record, [])
            mask = [label != -100 for label in row["labels"]]
            tokens = rows.lengths[i] if i is not None else len(row["input_ids"])
            shown.append(
                {
                    "index": first + j + 1,
                    "tokens": tokens,
                    "kept": len(row["input_ids"]),
                    "truncated": tokens > max_len,
                    "dropped": i is None,
                    "input_ids": row["input_ids"],
                    "trained": [int(x) for x in mask],
                    "spans": _spans(tok, row["input_ids"], mask),
                    "images": [
                        {"name": Path(p).name, "thumbnail": thumbnail(p, dcfg.max_image_pixels)}
                        for p in image_paths(as_parts(record["messages"]))
                    ],
                }
            )
    return {
        "file": path.name,
        "path": str(path),
        "format": source.format,
        "template": "processor's chat template",
        "max_seq_length": max_len,
        "records_total": file_entry(path)["records"] or len(records),
        "measured": len(lengths) + dropped,
        "records": shown,
        "histogram": histogram(lengths, max_len),
        "truncated": sum(1 for n_ in lengths if n_ > max_len),
        "dropped": dropped,
        "over_max_seq_length": sum(1 for n_ in lengths if n_ > max_len),
    }
