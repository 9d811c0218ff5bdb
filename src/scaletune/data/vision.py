"""Chat records with images, for a vision-language model (issue 37): `format: messages` whose
content holds `{"type": "image", "path": ...}` and `{"type": "text", "text": ...}` parts.

The model's processor renders each record (its chat template, then its image processor and
tokenizer: the image tokens it expands to are its own); only the assistant turns' tokens are
trained. Which tokens those are is found by rendering the conversation up to each assistant turn
(with the generation prompt) and through it: the turn's tokens are the difference, the rendering
of the prefix being a prefix of the whole's (checked). Image placeholder tokens are never trained.

Every record is read and rendered once when the data are built (every image opened, checked and
decoded; every problem named with its file and line, all at once), and again, lazily, when a batch
needs it (`VisionRows.__getitem__`): the image tensors are not held for the whole data set.
"""

from __future__ import annotations

from typing import Any

import torch

from scaletune.data.batching import Collator
from scaletune.data.sources import IGNORE_INDEX, read_image
from scaletune.data.templates import render_chat
from scaletune.errors import DataError
from scaletune.models.vision import TOKEN_INPUTS


def has_images(records: list[dict]) -> bool:
    """True when a record holds an image part (`data.sources` keeps such a record's `where`)."""
    return any("where" in r for r in records)


def image_records_problem(records: list[dict]) -> str:
    """The message for records with images given to a text-only model: the first five named."""
    where = [r["where"] for r in records if "where" in r]
    shown = "; ".join(where[:5]) + (f"; and {len(where) - 5} more" if len(where) > 5 else "")
    return (
        f"{len(where)} records hold images, and the model is a text-only model (no vision tower): fine-tune "
        f"a vision-language model on them (scaletune init-model idefics3-tiny), or remove the image parts ({shown})"
    )


def as_parts(messages: list[dict]) -> list[dict]:
    """`messages` with every content a list of parts (a plain string as one text part), as
    vision-language chat templates read them."""
    return [
        {"role": m["role"], "content": [{"type": "text", "text": c}] if isinstance(c := m["content"], str) else c}
        for m in messages
    ]


def image_paths(conversation: list[dict]) -> list[str]:
    """The paths of a conversation's image parts (:func:`as_parts`' layout), in order."""
    return [p["path"] for m in conversation for p in m["content"] if p["type"] == "image"]


class VisionRows(torch.utils.data.Dataset):
    """The rows of a vision-language model's data: item i is record i rendered by the processor,
    ``{"input_ids": [T], "labels": [T], "images": {key: tensor}}`` (the processor's image tensors,
    their first dimension the record's; `models.vision.IMAGE_INPUTS`), and the processor's
    per-token inputs where it gives them (`models.vision.TOKEN_INPUTS`: ``"token_type_ids": [T]``).

    Args:
        records: normalized `messages` records (`data.sources.load_records`).
        processor: the model's processor (`models.vision.load_processor`).
        max_len: `data.max_seq_length`; a longer record is cut there when no image token lies
            beyond the cut, else refused.
        max_pixels: `data.max_image_pixels`.
        image_token_ids: the ids never trained (the processor's image tokens: `data.build`).
        label: how the data are named in problems (`data.train`).
        template: the chat template (`data.chat_template`, else the processor's).

    Raises:
        DataError: every problem of every record, at once: an image that cannot be decoded (its
            path, header and size were checked when the records were read: `data.sources`); a
            record whose image tokens reach past
            `max_seq_length`; a chat template whose rendering of a conversation's start is not the
            start of its whole rendering.
    """

    def __init__(
        self,
        records: list[dict],
        processor: Any,
        *,
        max_len: int,
        max_pixels: int,
        image_token_ids: set[int],
        label: str,
        template: str,
    ) -> None:
        self.processor = processor
        self.template = template
        self.max_len = max_len
        self.max_pixels = max_pixels
        self.image_ids = torch.tensor(sorted(image_token_ids), dtype=torch.long)
        self.records: list[dict] = []
        self.spans: list[list[tuple[int, int]]] = []
        self.lengths: list[int] = []  # each kept record's tokens before the cut at max_len
        self.stats = {"records": len(records), "examples": 0, "truncated": 0, "dropped_empty": 0, "tokens": 0}
        self.stats["target_tokens"] = 0
        problems: list[str] = []
        for i, record in enumerate(records, 1):
            where = record.get("where", f"{label}: record {i}")
            try:
                spans, length = self._measure(record)
            except ValueError as exc:
                problems.append(f"{where}: {exc}")
                continue
            if not spans:
                self.stats["dropped_empty"] += 1
                continue
            self.stats["truncated"] += length > max_len
            self.stats["examples"] += 1
            self.stats["tokens"] += min(length, max_len)
            self.stats["target_tokens"] += sum(b - a for a, b in spans)
            self.records.append(record)
            self.spans.append(spans)
            self.lengths.append(length)
        if problems:
            raise DataError(problems, title="invalid data")

    def __len__(self) -> int:
        return len(self.records)

    def _texts(self, conversations: list[list[dict]], *, prompt: bool) -> list[str]:
        """The chat template's text of each conversation (ending with the generation prompt when
        `prompt`), rendered in the bounded child process (`data.templates.render_chat`): a chat
        template is a program that came with the model folder."""
        return render_chat(self.processor.tokenizer, self.template, conversations, prompt)

    def _encode(self, text: str, images: list) -> dict[str, torch.Tensor]:
        """The processor's tensors of `text` with its `images` (decoded; batch dimension 1)."""
        return self.processor(text=[text], return_tensors="pt", **({"images": [images]} if images else {}))

    def _measure(self, record: dict) -> tuple[list[tuple[int, int]], int]:
        """(the trained token spans [start, end) within max_len, the record's tokens before the cut)."""
        conv = as_parts(record["messages"])
        images = [read_image(p, self.max_pixels) for p in image_paths(conv)]  # decoded once for every prefix

        def ids_of(text: str, upto: int) -> torch.Tensor:  # the tokens of conv[:upto] rendered as `text`
            return self._encode(text, images[: len(image_paths(conv[:upto]))])["input_ids"][0]

        turns = [k for k, m in enumerate(conv) if m["role"] == "assistant"]
        closed = self._texts([conv] + [conv[: k + 1] for k in turns], prompt=False)
        opened = self._texts([conv[:k] for k in turns], prompt=True)
        ids = ids_of(closed[0], len(conv))
        spans = []
        for k, before, through in zip(turns, opened, closed[1:]):
            start_ids = ids_of(before, k)
            start, end = len(start_ids), len(ids if k + 1 == len(conv) else ids_of(through, k + 1))
            if not torch.equal(ids[:start], start_ids) or end > len(ids) or end <= start:
                raise ValueError(
                    f"the chat template renders the conversation up to turn {k} (with its generation prompt) as "
                    "something other than the start of the whole: its assistant tokens cannot be found"
                )
            spans.append((start, end))
        if len(ids) > self.max_len:
            images_at = torch.isin(ids, self.image_ids).nonzero()
            if len(images_at) and int(images_at[-1]) >= self.max_len:
                raise ValueError(
                    f"its image tokens reach position {int(images_at[-1]) + 1}, beyond data.max_seq_length "
                    f"{self.max_len}: raise it, or use smaller images"
                )
            spans = [(a, min(b, self.max_len)) for a, b in spans if a < self.max_len]
        # The causal shift: a row's first token is never a target.
        spans = [(max(a, 1), b) for a, b in spans if b > max(a, 1)]
        return spans, len(ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.row(self.records[i], self.spans[i])

    def row(self, record: dict, spans: list[tuple[int, int]]) -> dict[str, Any]:
        """`record` rendered as item i is (`spans`: its trained token spans; none for a record
        dropped for having no trained token, which the data preview shows)."""
        conv = as_parts(record["messages"])
        out = self._encode(
            self._texts([conv], prompt=False)[0], [read_image(p, self.max_pixels) for p in image_paths(conv)]
        )
        ids = out["input_ids"][0][: self.max_len]
        labels = torch.full_like(ids, IGNORE_INDEX)
        for a, b in spans:
            labels[a:b] = ids[a:b]
        labels[torch.isin(ids, self.image_ids)] = IGNORE_INDEX
        row: dict[str, Any] = {"input_ids": ids.tolist(), "labels": labels.tolist()}
        row.update({k: out[k][0][: self.max_len].tolist() for k in TOKEN_INPUTS if k in out})
        row["images"] = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", *TOKEN_INPUTS)}
        return row


class VisionCollator:
    """Pads a micro-batch of :class:`VisionRows` items: the text as `batching.Collator` does (right
    padding, `attention_mask`), the per-token inputs (`token_type_ids`) with 0, each image tensor
    zero-padded to the batch's largest size in every dimension after the first and concatenated
    along the first (the layout a processor gives a batch: Idefics3's `pixel_values`
    [B, images, 3, H, W] with `pixel_attention_mask` 0 on padding, Qwen2-VL's patches
    [patches, dim] with `image_grid_thw` [images, 3])."""

    def __init__(self, pad_token_id: int) -> None:
        self.text = Collator(pad_token_id)

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        out = self.text(rows)
        for key in TOKEN_INPUTS:
            if key in rows[0]:
                values = torch.zeros_like(out["input_ids"])
                for i, r in enumerate(rows):
                    values[i, : len(r[key])] = torch.as_tensor(r[key])
                out[key] = values
        keys = {k for r in rows for k in r["images"]}
        for key in sorted(keys):
            tensors = [r["images"][key] for r in rows if key in r["images"]]
            shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
            padded = []
            for t in tensors:
                pad: list[int] = []
                for d in reversed(range(1, t.dim())):
                    pad += [0, shape[d - 1] - t.shape[d]]
                padded.append(torch.nn.functional.pad(t, pad) if any(pad) else t)
            out[key] = torch.cat(padded)
        return out


def build_vision_rows(records: list[dict], processor: Any, **kwargs: Any) -> tuple[VisionRows, dict]:
    """:class:`VisionRows` over `records` (`kwargs`: its keyword arguments) and its counts
    (`data.build.DataBundle.stats`' keys, unprefixed)."""
    rows = VisionRows(records, processor, **kwargs)
    return rows, dict(rows.stats, rows=len(rows))
