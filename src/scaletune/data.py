"""Training data: reading records, prompt formats and chat templates, label masking, truncation,
packing, synthetic data, and the collator that turns rows into tensors.

Every row this module produces has three integer columns of equal length:

- ``input_ids``: token ids.
- ``labels``: Hugging Face convention, *unshifted*: ``labels[i] == input_ids[i]`` where token ``i``
  is trained and ``-100`` where it is not; the loss shifts (logits at ``i`` predict ``labels[i+1]``).
  The first token of every example is always ``-100``: nothing before it can predict it, so this
  changes no loss, makes ``(labels != -100).sum()`` the exact number of predicted tokens, and lets
  packing be plain concatenation (no prediction crosses from one example into the next).
- ``position_ids``: ``0, 1, 2, ...`` restarting at 0 at the start of every example.

Formats (``DataSource.format``):

- ``alpaca``: ``instruction``, ``input`` (optional), ``output``. The prompt is the Stanford Alpaca
  prompt (:data:`ALPACA_PROMPT`, :data:`ALPACA_PROMPT_NO_INPUT`), untrained; the target is
  ``output`` followed by the tokenizer's eos token. Prompt and target are tokenized separately, as
  at inference the prompt is tokenized alone.
- ``messages``: a list of ``{role, content}`` (roles system, user, assistant) rendered with a chat
  template: ``data.chat_template`` if given, else the tokenizer's own, else :data:`CHATML_TEMPLATE`.
  Only the content of assistant turns and the template's end-of-turn text after it (``<|im_end|>``
  for ChatML) are trained.
- ``text``: the field ``text`` (or ``DataSource.field``), all of it trained, eos appended.

Packing and attention: see :class:`Collator`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from scaletune.config import DataConfig, DataSource
from scaletune.errors import ConfigError, DataError

if TYPE_CHECKING:
    import datasets

IGNORE_INDEX = -100

ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)

#: The built-in chat template (ChatML), used when neither ``data.chat_template`` nor the tokenizer
#: has one. Each turn is ``<|im_start|>{role}\n{content}<|im_end|>\n``; the generation prompt is
#: ``<|im_start|>assistant\n``. Trained: an assistant turn's content and its ``<|im_end|>``. The markers
#: are single tokens only where the tokenizer knows them (the OLMo-2 tokenizer does; GPT-NeoX's
#: splits them into several ordinary tokens, which still trains correctly).
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

ROLES = ("system", "user", "assistant")
_MAX_PROBLEMS = 20
# Bump when tokenization or packing changes, so that stale cache files are not reused.
_CACHE_VERSION = "1"
# Examples are packed within chunks of this many (consecutive) examples, to bound memory.
_PACK_CHUNK = 10_000
# Attention implementations that build their mask through transformers' masking_utils, which
# separates packed sequences by position_ids when no attention_mask is given.
_PACKING_SAFE_ATTENTION = ("sdpa", "eager", "flex_attention")


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

    train: "datasets.Dataset"
    eval: "datasets.Dataset | None"
    stats: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Reading records


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


def _normalize(record: Any, source: DataSource, where: str) -> tuple[dict | None, list[str]]:
    """The record reduced to the fields its format uses, or the problems that prevent that."""
    if not isinstance(record, dict):
        return None, [f"{where}: expected an object, got {type(record).__name__}"]
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
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            problems.append(
                f"{where}: {name}[{j}] must be an object with 'role' (one of {', '.join(ROLES)}) "
                "and 'content' (a string)"
            )
            continue
        clean.append({"role": m["role"], "content": m["content"]})
    return (None if problems else {"messages": clean}), problems


def _looks_local(path: str) -> bool:
    return path.startswith((".", "/", "~")) or Path(path).suffix.lower() in (".json", ".jsonl", ".parquet", ".csv")


def load_records(source: DataSource) -> list[dict]:
    """Read and check the records of one data source.

    Accepts a local ``.json`` file (a list of objects), a ``.jsonl`` file (one object per line), a
    ``.parquet`` / ``.csv`` file, or a local folder / Hugging Face data set name, read with
    ``datasets.load_dataset(path, subset, split=split)``.

    Returns:
        At most ``source.max_samples`` records (the first ones), each reduced to the fields of its
        format: ``{instruction, input, output}`` (``input`` defaults to ""), ``{messages}`` or ``{text}``.

    Raises:
        DataError: the path does not exist (named); a JSONL line is not valid JSON (file:line); a
            record lacks a required field or has the wrong type (file, record number counted from
            1, line for JSONL, the field). All problems are reported at once, the first 20 listed.
    """
    path = os.path.expanduser(source.path)
    limit = source.max_samples
    problems: list[str] = []
    records: list[dict] = []

    def add(record: Any, where: str) -> None:
        norm, errs = _normalize(record, source, where)
        problems.extend(errs)
        if norm is not None:
            records.append(norm)

    p = Path(path)
    suffix = p.suffix.lower()
    if p.is_file() and suffix == ".jsonl":
        n = 0
        with open(p, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and n >= limit:
                    break
                if not line.strip():
                    continue
                n += 1
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    problems.append(f"{path}:{lineno}: not valid JSON: {exc.msg} (column {exc.colno})")
                    continue
                add(record, f"{path}:{lineno}: record {n}")
    elif p.is_file() and suffix == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            where = f"{path}:{exc.lineno}"
            raise DataError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})", title="invalid data")
        if not isinstance(data, list):
            raise DataError(
                f"{path}: a .json data file must hold a list of records (use .jsonl for one record per line)",
                title="invalid data",
            )
        for i, record in enumerate(data[:limit] if limit else data, 1):
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
    _raise(problems)
    if not records:
        raise DataError(f"{path}: no records", title="invalid data")
    return records


def _load_hf(source: DataSource, path: str) -> list[dict]:
    import datasets

    try:
        if Path(path).is_file():
            builder = Path(path).suffix.lower().lstrip(".")
            ds = datasets.load_dataset(builder, data_files=path, split="train")
        else:
            ds = datasets.load_dataset(path, source.subset, split=source.split)
    except Exception as exc:  # noqa: BLE001 - load_dataset raises many types; the user needs the message
        kind = "local folder" if Path(path).is_dir() else "not a local file or folder, so tried as a data set name;"
        msg = f"{path}: {kind} datasets.load_dataset failed: {type(exc).__name__}: {exc}"
        raise DataError(msg, title="invalid data")
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
            n = len(load_records(source))
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
    if problems:
        raise DataError(problems, title="invalid data")


# ---------------------------------------------------------------------------------------------
# Tokenization


def resolve_chat_template(data_cfg: DataConfig, tokenizer) -> str:
    """The Jinja chat template used for ``messages`` data: ``data.chat_template``, else the
    tokenizer's ``chat_template``, else :data:`CHATML_TEMPLATE`. Save it with the tokenizer so the
    trained model is prompted the way it was trained."""
    own = getattr(tokenizer, "chat_template", None)
    return data_cfg.chat_template or (own if isinstance(own, str) else None) or CHATML_TEMPLATE


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's serialized form and special tokens (a cache key part).

    The Rust tokenizer's truncation/padding state is left out: calling the tokenizer changes it.
    """
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
        if backend.truncation is not None or backend.padding is not None:
            state = json.loads(text)
            state["truncation"] = state["padding"] = None
            text = json.dumps(state)
        h.update(text.encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(repr((type(tokenizer).__name__, tokenizer.eos_token_id, tokenizer.bos_token_id)).encode())
    return h.hexdigest()


class _Encoder:
    """Batched ``Dataset.map`` function: records -> input_ids, labels, position_ids, truncated.

    Examples that keep no predicted token after truncation are dropped (the map returns fewer rows).
    """

    def __init__(self, tokenizer, fmt: str, max_len: int, template: str) -> None:
        self.tok, self.fmt, self.max_len, self.template = tokenizer, fmt, max_len, template

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        pairs = getattr(self, f"_{self.fmt}")(batch)
        out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "truncated": []}
        for ids, labels in pairs:
            truncated = len(ids) > self.max_len
            ids, labels = ids[: self.max_len], labels[: self.max_len]
            labels[0] = IGNORE_INDEX
            if all(x == IGNORE_INDEX for x in labels):
                continue
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["position_ids"].append(list(range(len(ids))))
            out["truncated"].append(truncated)
        return out

    def _eos(self) -> int:
        eos = self.tok.eos_token_id
        if eos is None:
            raise DataError(
                f"the tokenizer has no eos_token, which format {self.fmt} appends to every target; "
                "set tokenizer.eos_token", title="invalid data",
            )
        return eos

    def _alpaca(self, batch: dict[str, list]) -> list[tuple[list[int], list[int]]]:
        eos = self._eos()
        prompts = [
            (ALPACA_PROMPT if inp else ALPACA_PROMPT_NO_INPUT).format(instruction=ins, input=inp)
            for ins, inp in zip(batch["instruction"], batch["input"])
        ]
        prompt_ids = self.tok(prompts, add_special_tokens=True)["input_ids"]
        target_ids = self.tok(batch["output"], add_special_tokens=False)["input_ids"]
        return [(p + t + [eos], [IGNORE_INDEX] * len(p) + t + [eos]) for p, t in zip(prompt_ids, target_ids)]

    def _text(self, batch: dict[str, list]) -> list[tuple[list[int], list[int]]]:
        eos = self._eos()
        out = []
        for ids in self.tok(batch["text"], add_special_tokens=True)["input_ids"]:
            ids = ids if ids and ids[-1] == eos else ids + [eos]
            out.append((ids, list(ids)))
        return out

    def _render(self, convs: list[list[dict]], add_generation_prompt: bool) -> list[str]:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(
            conversations=convs,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            **self.tok.special_tokens_map,
        )
        return rendered

    def _messages(self, batch: dict[str, list]) -> list[tuple[list[int], list[int]]]:
        # Assistant spans are found on the rendered text, then mapped to tokens through the offsets
        # of ONE tokenization of the whole conversation, so no merge across a boundary can shift
        # them: the span of assistant turn i starts where render(turns[:i] + generation prompt)
        # ends and stops where render(turns[:i+1]) ends, less trailing whitespace (the newline
        # templates put between turns is not the model's to produce).
        texts, spans = [], []
        for conv in batch["messages"]:
            full = self._render([conv], False)[0]
            turns = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
            heads = self._render([conv[:i] for i in turns], True) if turns else []
            ends = self._render([conv[: i + 1] for i in turns], False) if turns else []
            conv_spans = []
            for head, end in zip(heads, ends):
                if not (full.startswith(head) and full.startswith(end) and len(end) >= len(head)):
                    raise DataError(
                        "the chat template does not render a conversation as a prefix of the longer "
                        "one (render(turns[:i]) must start render(turns)), so the assistant turns "
                        "cannot be located; set data.chat_template to a template that does",
                        title="invalid data",
                    )
                conv_spans.append((len(head), len(end.rstrip())))
            texts.append(full)
            spans.append(conv_spans)
        if not getattr(self.tok, "is_fast", False):
            raise DataError("format messages needs a fast (Rust) tokenizer for character offsets", title="invalid data")
        enc = self.tok(texts, add_special_tokens=False, return_offsets_mapping=True)
        out = []
        for ids, offsets, conv_spans in zip(enc["input_ids"], enc["offset_mapping"], spans):
            labels = [
                t if any(s <= start < e for s, e in conv_spans) else IGNORE_INDEX
                for t, (start, _) in zip(ids, offsets)
            ]
            out.append((ids, labels))
        return out


def _pack(batch: dict[str, list], max_len: int) -> dict[str, list]:
    """Greedy, order-preserving packing of consecutive examples into rows of at most max_len."""
    out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    cur: dict[str, list] = {k: [] for k in out}
    for ids, labels, pos in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
        if cur["input_ids"] and len(cur["input_ids"]) + len(ids) > max_len:
            for k in out:
                out[k].append(cur[k])
            cur = {k: [] for k in out}
        cur["input_ids"] += ids
        cur["labels"] += labels
        cur["position_ids"] += pos
    if cur["input_ids"]:
        for k in out:
            out[k].append(cur[k])
    return out


def _cache_root(cache_dir: str | Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("SCALETUNE_CACHE"):
        return Path(os.environ["SCALETUNE_CACHE"]).expanduser() / "datasets"
    return Path("~/.cache/scaletune/datasets").expanduser()


def _split_sizes(n: int, fraction: float) -> tuple[int, int]:
    n_eval = max(1, round(n * fraction))
    if n - n_eval < 1:
        raise DataError(
            f"data.eval_fraction {fraction} of {n} records leaves no training record", title="invalid data"
        )
    return n - n_eval, n_eval


def split_records(records: list, fraction: float, seed: int) -> tuple[list, list]:
    """Deterministic train/eval split: ``round(len * fraction)`` (at least 1) records chosen by a
    ``random.Random(seed)`` permutation go to eval; both parts keep the original order."""
    _, n_eval = _split_sizes(len(records), fraction)
    chosen = set(random.Random(seed).sample(range(len(records)), n_eval))
    train = [r for i, r in enumerate(records) if i not in chosen]
    evl = [r for i, r in enumerate(records) if i in chosen]
    return train, evl


def _tokenize(
    records: list[dict], source: DataSource, data_cfg: DataConfig, tokenizer, tok_hash: str, cache: Path, name: str
) -> tuple["datasets.Dataset", dict]:
    import datasets
    import pyarrow.compute as pc

    template = resolve_chat_template(data_cfg, tokenizer) if source.format == "messages" else ""
    h = hashlib.sha256()
    for part in (_CACHE_VERSION, source.format, tok_hash, str(data_cfg.max_seq_length), template):
        h.update(part.encode() + b"\0")
    h.update(json.dumps(records, sort_keys=True, ensure_ascii=False).encode())
    key = h.hexdigest()[:32]
    cache.mkdir(parents=True, exist_ok=True)
    num_proc = data_cfg.num_workers or None
    encoder = _Encoder(tokenizer, source.format, data_cfg.max_seq_length, template)
    # Fail here, in this process, on what would fail for every record (no eos, a template that
    # cannot be split into turns): worker processes would re-raise it less legibly.
    encoder({k: [v] for k, v in records[0].items()})
    raw = datasets.Dataset.from_list(records)
    ints = datasets.Sequence(datasets.Value("int32"))
    ds = raw.map(
        encoder,
        batched=True,
        remove_columns=raw.column_names,
        features=datasets.Features(
            {"input_ids": ints, "labels": ints, "position_ids": ints, "truncated": datasets.Value("bool")}
        ),
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
            _pack,
            batched=True,
            batch_size=_PACK_CHUNK,
            fn_kwargs={"max_len": data_cfg.max_seq_length},
            cache_file_name=str(cache / f"{key}-packed.arrow"),
            new_fingerprint=f"{key}-packed",
            num_proc=num_proc,
            desc=f"packing {name}",
        )
    return ds, stats


def _prefixed(name: str, **counts: int) -> dict:
    # train's dropped/truncated counts go unprefixed (the trainer logs them); records, rows,
    # tokens are always prefixed.
    bare = ("dropped_empty", "truncated") if name == "train" else ()
    return {(k if k in bare else f"{name}_{k}"): v for k, v in counts.items()}


def _row_stats(ds: "datasets.Dataset", name: str) -> dict:
    import pyarrow.compute as pc

    labels = pc.list_flatten(ds.data.column("labels"))
    return {
        f"{name}_rows": len(ds),
        f"{name}_tokens": len(labels),
        f"{name}_target_tokens": int(pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0),
    }


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
    return [
        {"input_ids": row, "labels": [IGNORE_INDEX] + row[1:], "position_ids": list(range(length))} for row in ids
    ]


def build_datasets(
    data_cfg: DataConfig,
    tokenizer,
    *,
    seed: int,
    max_positions: int | None = None,
    cache_dir: str | Path | None = None,
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

    ``data.dummy``, when set, replaces ``data.train`` (so ``data.dummy.num_samples=100`` on the
    command line turns any config into a smoke test).

    Returns:
        A :class:`DataBundle`. Rows keep the data order (the trainer's sampler shuffles); only the
        ``eval_fraction`` split draws records at random.

    Raises:
        DataError: ``max_seq_length`` exceeds ``max_positions``; any source problem (see
            :func:`load_records`); no example has a token to train on after truncation.
    """
    import datasets

    if max_positions is not None and data_cfg.max_seq_length > max_positions:
        raise DataError(
            f"data.max_seq_length ({data_cfg.max_seq_length}) is larger than the model's "
            f"max_position_embeddings ({max_positions}); set data.max_seq_length to {max_positions} or less",
            title="invalid data",
        )
    cache = _cache_root(cache_dir)
    stats: dict = {}
    evl = None
    eval_records = None
    eval_source = data_cfg.eval
    tok_hash = tokenizer_fingerprint(tokenizer) if data_cfg.dummy is None or data_cfg.eval is not None else ""

    if data_cfg.dummy is not None:  # already tokens, generated in memory: nothing to cache
        rows = _dummy_rows(data_cfg, len(tokenizer), seed)
        parts = {"train": rows}
        if data_cfg.eval_fraction is not None:
            parts["train"], parts["eval"] = split_records(rows, data_cfg.eval_fraction, seed)
        built = {}
        for name, part in parts.items():
            ds = datasets.Dataset.from_list(part)
            if data_cfg.packing:
                ds = ds.map(_pack, batched=True, batch_size=_PACK_CHUNK, fn_kwargs={"max_len": data_cfg.max_seq_length})
            built[name] = ds
            stats.update(_prefixed(name, records=len(part), examples=len(part), dropped_empty=0, truncated=0))
        train, evl = built["train"], built.get("eval")
    else:
        records = load_records(data_cfg.train)
        if data_cfg.eval_fraction is not None:
            records, eval_records = split_records(records, data_cfg.eval_fraction, seed)
            eval_source = data_cfg.train
        train, s = _tokenize(records, data_cfg.train, data_cfg, tokenizer, tok_hash, cache, "train")
        stats.update(s)
    if data_cfg.eval is not None:
        eval_records = load_records(data_cfg.eval)
    if eval_records is not None:
        evl, s = _tokenize(eval_records, eval_source, data_cfg, tokenizer, tok_hash, cache, "eval")
        stats.update(s)
    stats.update(_row_stats(train, "train"))
    if evl is not None:
        stats.update(_row_stats(evl, "eval"))
    return DataBundle(train=train, eval=evl, stats=stats)


# ---------------------------------------------------------------------------------------------
# Batching


def check_packing_support(attn_implementation: str | None, micro_batch_size: int) -> None:
    """Raise if packed rows would attend across examples with this attention implementation.

    transformers (5.x) keeps packed examples apart only when it is given no attention_mask and
    position_ids restart at each example: ``masking_utils`` then builds a block-diagonal causal
    mask for sdpa, eager and flex_attention. The flash-attention kernels read packing from
    position_ids only for a batch of ONE row (``_is_packed_sequence``); with more rows they would run
    plain causal attention across the examples of a row. Other (custom) implementations get no mask.

    Raises:
        ConfigError: naming data.packing and model.attn_implementation.
    """
    impl = attn_implementation or "sdpa"
    if impl in _PACKING_SAFE_ATTENTION:
        return
    if impl.startswith("flash_attention") and micro_batch_size == 1:
        return
    if impl.startswith("flash_attention"):
        raise ConfigError(
            f"data.packing with model.attn_implementation {impl} keeps packed examples apart only with "
            f"training.micro_batch_size 1 (it is {micro_batch_size}); set micro_batch_size: 1, or use sdpa",
            title="invalid config",
        )
    raise ConfigError(
        f"data.packing: model.attn_implementation {impl} cannot keep packed examples apart (attention would "
        f"leak between them); use one of {', '.join(_PACKING_SAFE_ATTENTION)} or set data.packing: false",
        title="invalid config",
    )


class Collator:
    """Pads rows into a micro-batch (right padding, to the longest row).

    Returns ``input_ids``, ``labels`` (-100 on padding), ``position_ids`` and, for a batch of unpacked
    rows, ``attention_mask`` (1 real, 0 padding): all ``[B, T]`` int64.

    A batch with a packed row (position_ids restart inside it) has NO ``attention_mask``. transformers
    turns a 2D mask into a plain causal+padding mask, which would let the examples of a pack see
    each other; without one, ``masking_utils.find_packed_sequence_indices`` splits each row where
    position_ids do not increase by 1 and masks attention block-diagonally (sdpa, eager, flex; see
    :func:`check_packing_support`). transformers does this only when there is no KV cache, so the
    model must be called with ``use_cache=False`` (or ``config.use_cache = False``): with the
    default ``use_cache=True`` it makes a ``DynamicCache`` even in training and packs leak silently.

    Padding gets position 0 at every pad token, so each pad token is its own one-token sequence
    (no fully masked softmax row), and the real length of a row stays readable from position_ids
    (see :func:`count_input_tokens`). Right padding never changes real tokens under causal attention.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        if pad_token_id is None:
            raise ValueError("Collator needs a pad_token_id (the tokenizer's pad or eos token id)")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            m = self.pad_to_multiple_of
            longest = (longest + m - 1) // m * m
        shape = (len(rows), longest)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        packed = False
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            input_ids[i, :n] = torch.as_tensor(r["input_ids"])
            labels[i, :n] = torch.as_tensor(r["labels"])
            pos = torch.as_tensor(r["position_ids"]) if "position_ids" in r else torch.arange(n)
            position_ids[i, :n] = pos
            attention_mask[i, :n] = 1
            packed = packed or bool((pos[1:] == 0).any())
        out = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
        if not packed:
            out["attention_mask"] = attention_mask
        return out


def count_target_tokens(labels: torch.Tensor) -> int:
    """Tokens the loss is computed on: ``(labels[:, 1:] != -100).sum()`` for ``[B, T]`` unshifted
    labels (the causal shift drops the first column)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def count_input_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Non-padding tokens of a :class:`Collator` batch (the ``tokens`` of metrics.jsonl).

    Uses ``attention_mask`` when present; for packed batches, the padding is the trailing run of
    position 0 (every example built here has at least 2 tokens, so its last position is >= 1).
    """
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    pos = batch["position_ids"]
    idx = torch.arange(1, pos.shape[1] + 1, device=pos.device)
    return int((idx * (pos != 0)).amax(dim=1).sum())
