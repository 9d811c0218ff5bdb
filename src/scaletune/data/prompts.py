"""Prompt data for online RL (`format: prompt`): records ``{prompt, ...fields}``, the prompt rendered
through the chat template up to where the assistant's answer starts, and collated left-padded for
generation. The other fields are kept (as JSON) for the reward functions (`scaletune.rewards`).

Records: ``prompt`` is a string (one user turn) or a list of ``{role, content}`` turns ending with a
user (or system) turn; any other field (e.g. ``answer``) is handed to each reward function as a
keyword argument, one value per completion.

Rows: ``prompt_ids`` (the rendered prompt's tokens, at most ``max_seq_length``; a longer prompt is
dropped), ``fields`` (the record's other fields as a JSON object), ``index`` (the record's place in
its split: rollouts.jsonl's ``prompt_index``, which `rl.engine: replay` looks completions up by).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from scaletune.data.templates import render_chat


class PromptEncoder:
    """Batched ``Dataset.map`` function: prompt records -> ``prompt_ids``, ``fields``, ``index``,
    ``truncated`` (always false: a prompt longer than `max_len` is dropped, not cut, since its
    end is where the answer starts)."""

    def __init__(self, tokenizer: Any, max_len: int, template: str) -> None:
        self.tok, self.max_len, self.template = tokenizer, max_len, template

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        texts = render_chat(self.tok, self.template, batch["prompt"], True)
        ids = self.tok(texts, add_special_tokens=False)["input_ids"]
        out: dict[str, list] = {"prompt_ids": [], "fields": [], "index": [], "truncated": []}
        for row, fields, index in zip(ids, batch["fields"], batch["index"]):
            if not row or len(row) > self.max_len:
                continue
            out["prompt_ids"].append(row)
            out["fields"].append(fields)
            out["index"].append(index)
            out["truncated"].append(False)
        return out


def features() -> Any:
    """The `datasets.Features` of prompt rows (before `truncated` is dropped)."""
    import datasets

    return datasets.Features(
        {
            "prompt_ids": datasets.Sequence(datasets.Value("int32")),
            "fields": datasets.Value("string"),
            "index": datasets.Value("int64"),
            "truncated": datasets.Value("bool"),
        }
    )


class PromptCollator:
    """A micro-batch of m prompts, left-padded (generation appends on the right).

    Returns ``prompt_ids`` [m, P] int64, ``prompt_mask`` [m, P] (1 real, 0 padding), ``index`` [m]
    int64 and ``fields`` (a list of m dicts).
    """

    def __init__(self, pad_token_id: int) -> None:
        self.pad = pad_token_id

    def __call__(self, rows: list[dict]) -> dict[str, Any]:
        longest = max(len(r["prompt_ids"]) for r in rows)
        ids = torch.full((len(rows), longest), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["prompt_ids"])
            ids[i, longest - n :] = torch.as_tensor(r["prompt_ids"], dtype=torch.long)
            mask[i, longest - n :] = 1
        return {
            "prompt_ids": ids,
            "prompt_mask": mask,
            "index": torch.tensor([int(r["index"]) for r in rows], dtype=torch.long),
            "fields": [json.loads(r["fields"]) for r in rows],
        }
