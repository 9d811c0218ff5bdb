"""Building the train and eval data sets: read, split, tokenize, mask, truncate, pack and cache
(the row format is described in :mod:`scaletune.data`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import filelock
import jinja2
import torch

from scaletune.config import DataConfig, DataSource
from scaletune.data.packing import PACK_CHUNK, pack_rows
from scaletune.data.sources import IGNORE_INDEX, load_records, split_records
from scaletune.data.templates import Encoder, is_chat, resolve_chat_template, tokenizer_fingerprint
from scaletune.errors import DataError
from scaletune.resolve import positions_problem

if TYPE_CHECKING:
    import datasets

# Bump when tokenization or packing changes, so that stale cache files are not reused.
_CACHE_VERSION = "1"
#: From this many records on, tokenizing takes long enough to watch: `datasets` draws its progress
#: bars. Below, it takes seconds and the bars are noise; the stage line ("N sequences") sums it up.
BAR_MIN_RECORDS = 10_000


@dataclass
class DataBundle:
    """What the training loop consumes.

    Attributes:
        train: columns ``input_ids``, ``labels``, ``position_ids`` (lists of int, equal lengths, at most
            ``max_seq_length``); one row is one training sequence (a packed row when packing).
        eval: the same columns, or None without ``data.eval`` / ``data.eval_fraction``.
        stats: counts: ``train_records`` (records after the eval split), ``dropped_empty``
            (examples left without a trained token by truncation, dropped), ``truncated`` (examples
            cut at max_seq_length and kept), ``train_examples`` (kept), ``train_rows`` (after packing),
            ``train_tokens``, ``train_target_tokens`` (labels != -100); with eval data the same
            with an ``eval_`` prefix (``eval_dropped_empty``, ``eval_truncated``, ...).
    """

    train: datasets.Dataset
    eval: datasets.Dataset | None
    stats: dict = field(default_factory=dict)
    collator: Any = None  # a data factory's own; None: `batching.Collator` over the text rows


@contextlib.contextmanager
def progress_bars(records: int) -> Iterator[None]:
    """`datasets`' progress bars (map, filter) on for `records` >= :data:`BAR_MIN_RECORDS`, off
    below (as they were after)."""
    import datasets

    if records >= BAR_MIN_RECORDS or not datasets.is_progress_bar_enabled():
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()


def cache_root(cache_dir: str | Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("SCALETUNE_CACHE"):
        return Path(os.environ["SCALETUNE_CACHE"]).expanduser() / "datasets"
    return Path("~/.cache/scaletune/datasets").expanduser()


def encoding(source: DataSource, data_cfg: DataConfig, tokenizer) -> tuple[str, str]:
    """(the encoder's format, the chat template or "") `source` is tokenized with: alpaca with
    `template: chat` is `alpaca_chat`; messages, preference and kto records and chat alpaca go
    through the resolved chat template."""
    chat = is_chat(source)
    template = resolve_chat_template(data_cfg, tokenizer) if chat else ""
    return ("alpaca_chat" if source.format == "alpaca" and chat else source.format), template


def sft_encoder(source: DataSource, data_cfg: DataConfig, tokenizer) -> Encoder:
    """The encoder :func:`build_datasets` tokenizes an alpaca, messages or text `source` with (the
    serve page's data preview calls it, so it shows what training sees)."""
    fmt, template = encoding(source, data_cfg, tokenizer)
    return Encoder(tokenizer, fmt, data_cfg.max_seq_length, template)


def _encoder(source_format: str, fmt: str, data_cfg: DataConfig, tokenizer, template: str) -> tuple[Any, Any]:
    """(the `Dataset.map` function, its row `datasets.Features`) of a source's format."""
    import datasets

    if source_format == "prompt":
        from scaletune.data import prompts

        return prompts.PromptEncoder(tokenizer, data_cfg.max_seq_length, template), prompts.features()
    if source_format in ("preference", "kto"):
        from scaletune.data.preference import PreferenceEncoder, features

        return PreferenceEncoder(tokenizer, fmt, data_cfg.max_seq_length, template), features(fmt)
    ints = datasets.Sequence(datasets.Value("int32"))
    row_features = datasets.Features(
        {"input_ids": ints, "labels": ints, "position_ids": ints, "truncated": datasets.Value("bool")}
    )
    return Encoder(tokenizer, fmt, data_cfg.max_seq_length, template), row_features


def _tokenize(
    records: list[dict], source: DataSource, data_cfg: DataConfig, tokenizer, tok_hash: str, cache: Path, name: str
) -> tuple[datasets.Dataset, dict]:
    import datasets
    import pyarrow.compute as pc

    if source.format in ("preference", "kto", "prompt"):
        from scaletune.data.preference import with_kl_completions

        # `index` keys a pair's precomputed reference log-probs and a prompt's rollouts (replay);
        # kto's KL rows are fixed here.
        records = [{**r, "index": i} for i, r in enumerate(records)]
        records = with_kl_completions(records) if source.format == "kto" else records
    fmt, template = encoding(source, data_cfg, tokenizer)
    h = hashlib.sha256()
    for part in (_CACHE_VERSION, fmt, tok_hash, str(data_cfg.max_seq_length), template):
        h.update(part.encode() + b"\0")
    h.update(json.dumps(records, sort_keys=True, ensure_ascii=False).encode())
    key = h.hexdigest()[:32]
    cache.mkdir(parents=True, exist_ok=True)
    num_proc = data_cfg.num_workers or None
    encoder, row_features = _encoder(source.format, fmt, data_cfg, tokenizer, template)
    # Fail here, in this process, on what would fail for every record (no eos, a template that
    # cannot be split into turns): worker processes would re-raise it less legibly.
    try:
        encoder({k: [v] for k, v in records[0].items()})
    except jinja2.TemplateError as exc:
        raise DataError(f"data.{name}: the chat template fails on record 1: {exc}", title="invalid data") from None
    # One writer per cache entry: ranks (or jobs) that share a cache and miss it together would each
    # tokenize into the same files at once; the others wait here, then read the first one's files.
    with filelock.FileLock(str(cache / f"{key}.lock")):
        raw = datasets.Dataset.from_list(records)
        ds = raw.map(
            encoder,
            batched=True,
            remove_columns=raw.column_names,
            features=row_features,
            cache_file_name=str(cache / f"{key}-tokens.arrow"),
            new_fingerprint=f"{key}-tokens",
            num_proc=num_proc,
            desc=f"tokenizing {name}",
        )
        if len(ds) == 0:
            raise DataError(
                f"data.{name} ({source.path}): all {len(records)} records were dropped: none has a token "
                f"to train on within data.max_seq_length ({data_cfg.max_seq_length}) tokens (every response "
                "was truncated away, or the targets are empty); raise data.max_seq_length",
                title="invalid data",
            )
        stats = _prefixed(
            name,
            records=len(records),
            examples=len(ds),
            dropped_empty=len(records) - len(ds),
            truncated=int(pc.sum(ds.data.column("truncated")).as_py() or 0),
        )
        ds = ds.remove_columns("truncated")
        if data_cfg.packing:
            ds = ds.map(
                pack_rows,
                batched=True,
                batch_size=PACK_CHUNK,
                fn_kwargs={"max_len": data_cfg.max_seq_length},
                cache_file_name=str(cache / f"{key}-packed.arrow"),
                new_fingerprint=f"{key}-packed",
                num_proc=num_proc,
                desc=f"packing {name}",
            )
    return ds, stats


def describe_stats(stats: dict) -> str:
    """:attr:`DataBundle.stats` in words, per split: records, examples kept (truncated, dropped),
    rows, tokens (trained); a data factory's sample counts as they are.

    Example: ``train: 96 records, 96 examples (3 truncated, 0 dropped), 96 rows, 20,480 tokens
    (8,192 trained)``.
    """
    parts = []
    for name in ("train", "eval"):
        bare = ("dropped_empty", "truncated") if name == "train" else ()  # as _prefixed names them

        def count(key: str, name: str = name, bare: tuple = bare) -> int | None:
            return stats.get(key if key in bare else f"{name}_{key}")

        if count("samples") is not None:
            parts.append(f"{name}: {count('samples'):,} samples")
            continue
        words = []
        if count("records") is not None:
            words.append(f"{count('records'):,} records")
        if count("examples") is not None:
            kept = f"{count('examples'):,} examples"
            words.append(f"{kept} ({count('truncated') or 0:,} truncated, {count('dropped_empty') or 0:,} dropped)")
        if count("rows") is not None:
            words.append(f"{count('rows'):,} rows")
        if count("tokens") is not None:
            words.append(f"{count('tokens'):,} tokens ({count('target_tokens') or 0:,} trained)")
        if words:
            parts.append(f"{name}: " + ", ".join(words))
    return "; ".join(parts)


def _prefixed(name: str, **counts: int) -> dict:
    # train's dropped/truncated counts go unprefixed (the trainer logs them); records, rows,
    # tokens are always prefixed.
    bare = ("dropped_empty", "truncated") if name == "train" else ()
    return {(k if k in bare else f"{name}_{k}"): v for k, v in counts.items()}


def _row_stats(ds: datasets.Dataset, name: str) -> dict:
    import pyarrow as pa
    import pyarrow.compute as pc

    if "prompt_ids" in ds.column_names:  # prompts: their tokens, nothing trained until generated
        prompts = pc.list_flatten(ds.data.column("prompt_ids"))
        return {f"{name}_rows": len(ds), f"{name}_tokens": len(prompts), f"{name}_target_tokens": 0}
    if "chosen_labels" in ds.column_names:  # preference pairs: both sides' tokens
        labels = pa.concat_arrays(
            [pc.list_flatten(ds.data.column(c)).combine_chunks() for c in ("chosen_labels", "rejected_labels")]
        )
    else:
        labels = pc.list_flatten(ds.data.column("labels"))
    return {
        f"{name}_rows": len(ds),
        f"{name}_tokens": len(labels),
        f"{name}_target_tokens": int(pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0),
    }


def _dummy_datasets(data_cfg: DataConfig, vocab_size: int, seed: int, stats: dict) -> dict[str, datasets.Dataset]:
    """`data.dummy`'s rows (train, and eval with `eval_fraction`), packed when asked; their counts added to `stats`."""
    import datasets

    rows = _dummy_rows(data_cfg, vocab_size, seed)
    parts = {"train": rows}
    if data_cfg.eval_fraction is not None:
        parts["train"], parts["eval"] = split_records(rows, data_cfg.eval_fraction, seed)
    built = {}
    for name, part in parts.items():
        ds = datasets.Dataset.from_list(part)
        if data_cfg.packing:
            with progress_bars(len(part)):
                ds = ds.map(
                    pack_rows, batched=True, batch_size=PACK_CHUNK, fn_kwargs={"max_len": data_cfg.max_seq_length}
                )
        built[name] = ds
        stats.update(_prefixed(name, records=len(part), examples=len(part), dropped_empty=0, truncated=0))
    return built


def _vision_bundle(data_cfg: DataConfig, processor: Any, seed: int) -> DataBundle:
    """The train (and eval) rows of a vision-language model (`data.vision`), with their collator.

    Raises:
        DataError: a source that is not `messages`; every record's problem (`data.vision.VisionRows`).
    """
    from scaletune.data.vision import VisionCollator

    sources = {"train": data_cfg.train, "eval": data_cfg.eval}
    wrong = [
        f"data.{name}: format {s.format!r}; a vision-language model trains on format messages"
        for name, s in sources.items()
        if s is not None and s.format != "messages"
    ]
    if wrong:
        raise DataError(wrong, title="invalid data")
    assert data_cfg.train is not None
    records = load_records(data_cfg.train, max_pixels=data_cfg.max_image_pixels)
    parts = {"train": records}
    if data_cfg.eval_fraction is not None:
        parts["train"], parts["eval"] = split_records(records, data_cfg.eval_fraction, seed)
    if data_cfg.eval is not None:
        parts["eval"] = load_records(data_cfg.eval, max_pixels=data_cfg.max_image_pixels)
    built: dict[str, Any] = {}
    stats: dict = {}
    for name, part in parts.items():
        built[name], counts = vision_rows(part, data_cfg, processor, f"data.{name}")
        stats.update(_prefixed(name, **counts))
    pad = processor.tokenizer.pad_token_id
    return DataBundle(train=built["train"], eval=built.get("eval"), stats=stats, collator=VisionCollator(pad))


def _text_only(records: list[dict]) -> list[dict]:
    """`records`, when none holds an image (a text model's data).

    Raises:
        DataError: records with image parts, the first five named.
    """
    from scaletune.data.vision import has_images, image_records_problem

    if has_images(records):
        raise DataError(image_records_problem(records), title="invalid data")
    return records


def vision_rows(records: list[dict], data_cfg: DataConfig, processor: Any, label: str) -> tuple[Any, dict]:
    """`data.vision.VisionRows` over `records` as training builds them (the processor's image
    tokens never trained; `data.chat_template`, else the processor's), and their counts.

    Raises:
        DataError: the processor has no chat template; every record's problem, each named by
            `label` or its file and line.
    """
    from scaletune.data.vision import build_vision_rows

    ids = {processor.tokenizer.convert_tokens_to_ids(t) for t in _image_tokens(processor)}
    template = data_cfg.chat_template or getattr(processor, "chat_template", None)
    if not template:
        raise DataError("the model's processor has no chat template: set data.chat_template", title="invalid data")
    return build_vision_rows(
        records,
        processor,
        max_len=data_cfg.max_seq_length,
        max_pixels=data_cfg.max_image_pixels,
        image_token_ids=ids,
        label=label,
        template=template,
    )


def _image_tokens(processor: Any) -> list[str]:
    """The processor's image tokens (`image_token`, Idefics3's wrapping `fake_image_token` and
    `global_image_tag`, Gemma 3's `boi_token` and `eoi_token`), named on the processor or on its
    tokenizer (Gemma 3's processor calls its begin-of-image token `image_token`; the soft token the
    features replace is the tokenizer's): placeholders for image features and their frame, never
    trained."""
    names = ("image_token", "fake_image_token", "global_image_tag", "boi_token", "eoi_token")
    found = [getattr(owner, n, None) for owner in (processor, processor.tokenizer) for n in names]
    tokens = {t if isinstance(t, str) else getattr(t, "content", None) for t in found}
    return sorted(t for t in tokens if t)


def _dummy_rows(data_cfg: DataConfig, vocab_size: int, seed: int) -> list[dict]:
    n = data_cfg.dummy.num_samples
    length = data_cfg.dummy.seq_length or data_cfg.max_seq_length
    if length > data_cfg.max_seq_length:
        raise DataError(
            f"data.dummy.seq_length ({length}) is larger than data.max_seq_length ({data_cfg.max_seq_length})",
            title="invalid data",
        )
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n, length), generator=gen).tolist()
    return [{"input_ids": row, "labels": [IGNORE_INDEX] + row[1:], "position_ids": list(range(length))} for row in ids]


def build_datasets(
    data_cfg: DataConfig,
    tokenizer,
    *,
    seed: int,
    max_positions: int | None = None,
    cache_dir: str | Path | None = None,
    processor: Any = None,
) -> DataBundle:
    """Read, split, tokenize, mask, truncate and (optionally) pack the train and eval data.

    Args:
        data_cfg: the ``data`` section.
        tokenizer: a Hugging Face tokenizer (fast for ``messages``) with an eos token (``alpaca``,
            ``text``).
        seed: seeds the ``eval_fraction`` split and dummy data.
        max_positions: the model's ``max_position_embeddings``; ``max_seq_length`` may not exceed it.
        cache_dir: where tokenized data are cached (Arrow files, reused by a later call with the
            same records, format, tokenizer, max_seq_length and chat template); default
            ``$SCALETUNE_CACHE/datasets``, else ``~/.cache/scaletune/datasets``.
        processor: a vision-language model's processor (`models.vision.load_processor`): its
            `messages` records, with or without images, become `data.vision.VisionRows` (not cached:
            rendered again when a batch needs them) with their own collator.

    ``data.dummy``, when set, replaces ``data.train`` (so ``data.dummy.num_samples=100`` on the
    command line turns any config into a smoke test).

    Returns:
        A :class:`DataBundle`. Rows keep the data order (the trainer's sampler shuffles); only the
        ``eval_fraction`` split draws records at random.

    Raises:
        DataError: ``max_seq_length`` exceeds ``max_positions``; any source problem (see
            :func:`load_records`); no example has a token to train on after truncation.
    """

    too_long = positions_problem(data_cfg.max_seq_length, max_positions)
    if too_long is not None:  # a resolved run has passed this rule; direct callers of this function may not
        raise DataError(too_long.text(), title="invalid data")
    cache = cache_root(cache_dir)
    stats: dict = {}
    evl = None
    eval_records = None
    eval_source = data_cfg.eval
    tok_hash = tokenizer_fingerprint(tokenizer) if data_cfg.dummy is None or data_cfg.eval is not None else ""

    if data_cfg.dummy is not None:  # already tokens, generated in memory: nothing to cache
        built = _dummy_datasets(data_cfg, len(tokenizer), seed, stats)
        train, evl = built["train"], built.get("eval")
    elif processor is not None:
        return _vision_bundle(data_cfg, processor, seed)
    else:
        records = load_records(data_cfg.train)
        _text_only(records)
        if data_cfg.eval_fraction is not None:
            records, eval_records = split_records(records, data_cfg.eval_fraction, seed)
            eval_source = data_cfg.train
        with progress_bars(len(records)):
            train, s = _tokenize(records, data_cfg.train, data_cfg, tokenizer, tok_hash, cache, "train")
        stats.update(s)
    if data_cfg.eval is not None:
        eval_records = _text_only(load_records(data_cfg.eval))
    if eval_records is not None:
        with progress_bars(len(eval_records)):
            evl, s = _tokenize(eval_records, eval_source, data_cfg, tokenizer, tok_hash, cache, "eval")
        stats.update(s)
    stats.update(_row_stats(train, "train"))
    if evl is not None:
        stats.update(_row_stats(evl, "eval"))
    return DataBundle(train=train, eval=evl, stats=stats)
