"""Prompt formats and chat templates, and the encoder that turns records into token ids and
labels (alpaca, messages, text)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

from scaletune.config import DataConfig, DataSource
from scaletune.data.sources import IGNORE_INDEX
from scaletune.errors import DataError

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

ALPACA_FIELDS = ("instruction", "input", "output")


def alpaca_prompt(instruction: str, input: str = "") -> str:
    """Stanford Alpaca's prompt for one record (the text before the response)."""
    return (ALPACA_PROMPT if input else ALPACA_PROMPT_NO_INPUT).format(instruction=instruction, input=input)


def alpaca_messages(instruction: str, input: str, output: str | None) -> list[dict]:
    """An alpaca record as chat turns (`DataSource.template: chat`): the user says the instruction,
    then the input after a blank line; the assistant answers the output (left out when None, for a
    prompt to be answered)."""
    user = f"{instruction}\n\n{input}" if input else instruction
    turns = [{"role": "user", "content": user}]
    return turns if output is None else [*turns, {"role": "assistant", "content": output}]


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


def resolve_chat_template(data_cfg: DataConfig | None, tokenizer) -> str:
    """The Jinja chat template used for ``messages`` data (and alpaca records with ``template: chat``):
    ``data.chat_template``, else the tokenizer's ``chat_template``, else :data:`CHATML_TEMPLATE`.
    Save it with the tokenizer so the trained model is prompted the way it was trained."""
    own = getattr(tokenizer, "chat_template", None)
    mine = data_cfg.chat_template if data_cfg is not None else None
    return mine or (own if isinstance(own, str) else None) or CHATML_TEMPLATE


def is_chat(source: DataSource) -> bool:
    """Whether `source` is tokenized through the chat template: messages, preference, kto and
    prompt records, and alpaca records with `template: chat`."""
    return source.format in ("preference", "kto", "messages", "prompt") or source.template == "chat"


def trained_chat_template(stage_data: Iterable[DataConfig], tokenizer) -> str | None:
    """The chat template a run rendered its data with (`resolve_chat_template` of the last stage
    whose train or eval data is chat-shaped), or None when no stage's was. `final/` and `scaletune
    export` write it into the tokenizer they save, so the model is prompted elsewhere (transformers,
    vLLM, a hub upload) as it was trained: a base without a template trained on `messages` learned
    ChatML, which its own tokenizer does not say."""
    template = None
    for data in stage_data:
        if any(s is not None and is_chat(s) for s in (data.train, data.eval)):
            template = resolve_chat_template(data, tokenizer)
    return template


def render_chat(tokenizer, template: str, conversations: list[list[dict]], add_generation_prompt: bool) -> list[str]:
    """Each conversation rendered to text with the Jinja `template` (and the tokenizer's special
    tokens as template variables): the one rendering of training data and of inference prompts, which
    are then tokenized without added special tokens. Rendered by transformers in a child process,
    bounded in time and memory (:mod:`scaletune.data.render`).

    Raises:
        DataError: the template ran out of time or memory.
        jinja2.TemplateError: the template's own error.
    """
    from scaletune.data.render import render_bounded

    return render_bounded(template, conversations, add_generation_prompt, dict(tokenizer.special_tokens_map))


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


class Encoder:
    """Batched ``Dataset.map`` function: records -> input_ids, labels, position_ids, truncated.

    Examples that keep no predicted token after truncation are dropped (the map returns fewer rows).
    """

    def __init__(self, tokenizer, fmt: str, max_len: int, template: str) -> None:
        self.tok, self.fmt, self.max_len, self.template = tokenizer, fmt, max_len, template

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "truncated": []}
        for ids, labels in self.pairs(batch):
            row = self.cut(ids, labels)
            if row is None:
                continue
            out["input_ids"].append(row[0])
            out["labels"].append(row[1])
            out["position_ids"].append(list(range(len(row[0]))))
            out["truncated"].append(row[2])
        return out

    def pairs(self, batch: dict[str, list]) -> list[tuple[list[int], list[int]]]:
        """(input_ids, labels) of every record of `batch`, in order, before truncation (the serve
        page's data preview measures and shows them; training keeps `cut`'s part).

        Raises:
            DataError: the tokenizer lacks what the format needs (an eos token, a fast tokenizer),
                or the chat template cannot be split into turns.
            jinja2.TemplateError: the chat template's own error.
        """
        return getattr(self, f"_{self.fmt}")(batch)

    def cut(self, ids: list[int], labels: list[int]) -> tuple[list[int], list[int], bool] | None:
        """One pair as training keeps it: (ids, labels, truncated) cut at max_len with the first
        label masked, or None when no trained token is left (the example is dropped)."""
        truncated = len(ids) > self.max_len
        ids, labels = ids[: self.max_len], labels[: self.max_len]
        labels[0] = IGNORE_INDEX
        if all(x == IGNORE_INDEX for x in labels):
            return None
        return ids, labels, truncated

    def _eos(self) -> int:
        eos = self.tok.eos_token_id
        if eos is None:
            raise DataError(
                f"the tokenizer has no eos_token, which format {self.fmt} appends to every target; "
                "set tokenizer.eos_token",
                title="invalid data",
            )
        return eos

    def _alpaca(self, batch: dict[str, list]) -> list[tuple[list[int], list[int]]]:
        eos = self._eos()
        prompts = [alpaca_prompt(ins, inp) for ins, inp in zip(batch["instruction"], batch["input"])]
        prompt_ids = self.tok(prompts, add_special_tokens=True)["input_ids"]
        target_ids = self.tok(batch["output"], add_special_tokens=False)["input_ids"]
        return [(p + t + [eos], [IGNORE_INDEX] * len(p) + t + [eos]) for p, t in zip(prompt_ids, target_ids)]

    def _alpaca_chat(self, batch: dict[str, list]) -> list[tuple[list[int], list[int]]]:
        return self._messages({"messages": [alpaca_messages(*r) for r in zip(*(batch[k] for k in ALPACA_FIELDS))]})

    def _text(self, batch: dict[str, list]) -> list[tuple[list[int], list[int]]]:
        eos = self._eos()
        out = []
        for ids in self.tok(batch["text"], add_special_tokens=True)["input_ids"]:
            ids = ids if ids and ids[-1] == eos else ids + [eos]
            out.append((ids, list(ids)))
        return out

    def _render(self, convs: list[list[dict]], add_generation_prompt: bool) -> list[str]:
        return render_chat(self.tok, self.template, convs, add_generation_prompt)

    def _messages(self, batch: dict[str, list]) -> list[tuple[list[int], list[int]]]:
        # Assistant spans are found on the rendered text, then mapped to tokens through the offsets
        # of ONE tokenization of the whole conversation, so no merge across a boundary can shift
        # them: the span of assistant turn i starts where render(turns[:i] + generation prompt)
        # ends and stops where render(turns[:i+1]) ends, less trailing whitespace (the newline
        # templates put between turns is not the model's to produce). Only the turns that start
        # inside the first max_len tokens are located (the rest is cut): rendering every prefix of
        # a long conversation is quadratic in its turns (100,000 turns took hours).
        convs = batch["messages"]
        texts = self._render(convs, False)
        if not getattr(self.tok, "is_fast", False):
            raise DataError("format messages needs a fast (Rust) tokenizer for character offsets", title="invalid data")
        enc = self.tok(texts, add_special_tokens=False, return_offsets_mapping=True)
        out = []
        for conv, full, ids, offsets in zip(convs, texts, enc["input_ids"], enc["offset_mapping"]):
            # The start of the last token kept: a span that starts after it labels nothing kept.
            limit = offsets[self.max_len - 1][0] if len(ids) > self.max_len else len(full)
            spans = self._spans(conv, full, limit)
            out.append((ids, span_labels(ids, offsets, spans, self.max_len)))
        return out

    def _spans(self, conv: list[dict], full: str, limit: int) -> list[tuple[int, int]]:
        """(start, end) characters of each assistant turn of `conv` (rendered as `full`) that starts
        at or before character `limit`; the prefixes are rendered a few at a time, 8 then twice as
        many, so a short conversation costs one render of its heads and one of its ends."""
        turns = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
        spans: list[tuple[int, int]] = []
        done, chunk = 0, 8
        while done < len(turns):
            part = turns[done : done + chunk]
            heads = self._render([conv[:i] for i in part], True)
            ends = self._render([conv[: i + 1] for i in part], False)
            for head, end in zip(heads, ends):
                if len(head) > limit:
                    return spans
                if not (full.startswith(head) and full.startswith(end) and len(end) >= len(head)):
                    raise DataError(
                        "the chat template does not render a conversation as a prefix of the longer "
                        "one (render(turns[:i]) must start render(turns)), so the assistant turns "
                        "cannot be located; set data.chat_template to a template that does",
                        title="invalid data",
                    )
                spans.append((len(head), len(end.rstrip())))
            done, chunk = done + len(part), chunk * 2
        return spans


def span_labels(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]], keep: int) -> list[int]:
    """Labels of a tokenized conversation: a token whose first character lies in an assistant span
    `[start, end)` is its own target, any other -100; tokens from `keep` on are -100 (truncated
    away). One pass over the tokens and the merged spans (offsets of a fast tokenizer increase; a
    step back restarts the span pointer)."""
    merged: list[list[int]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    labels = [IGNORE_INDEX] * len(ids)
    j, previous = 0, -1
    for t in range(min(len(ids), keep)):
        start = offsets[t][0]
        if start < previous:
            j = 0
        previous = start
        while j < len(merged) and merged[j][1] <= start:
            j += 1
        if j < len(merged) and merged[j][0] <= start:
            labels[t] = ids[t]
    return labels
