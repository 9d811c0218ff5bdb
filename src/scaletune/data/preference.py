"""Preference data (`format: preference`, `format: kto`): records checked and reduced to chat turns,
rendered through the chat template with only the completion trained, and collated so that the
chosen and rejected answers of a micro-batch go through the model in ONE forward.

Records:

- ``preference``: ``{prompt, chosen, rejected}``. ``prompt`` is a string (one user turn) or a list
  of ``{role, content}`` turns (a conversation ending where the answer starts); ``chosen`` and
  ``rejected`` are strings (one assistant turn) or lists of turns.
- ``kto``: ``{prompt, completion, label}`` with ``label`` true (desirable) or false (undesirable).

Rows (one per pair; each side has the row format of :mod:`scaletune.data`: unshifted labels, -100
on the prompt and on the first token):

- preference: ``chosen_input_ids``, ``chosen_labels``, ``rejected_input_ids``, ``rejected_labels``,
  ``index`` (the pair's place in its split, which keys the precomputed reference log-probs);
- kto: ``input_ids``, ``labels``, ``kl_input_ids``, ``kl_labels`` (record i's prompt with record
  (i - 1) mod N's completion, in file order, as TRL's `KTOTrainer` pairs them within a batch: the
  mismatched pairs KTO's KL estimate is taken over, fixed by the data rather than by the batching, so the estimate does not depend on world size or
  micro-batch split), ``desirable``, ``index``.

A pair whose chosen or rejected side keeps no trained token within ``max_seq_length`` is dropped.
"""

from __future__ import annotations

from typing import Any

import torch

from scaletune.data.sources import IGNORE_INDEX
from scaletune.data.templates import Encoder, span_labels


def with_kl_completions(records: list[dict]) -> list[dict]:
    """KTO records with ``kl_completion``: the completion of record (i - 1) mod N, the mismatched
    pairs of the KL estimate (TRL 1.16's `KTOTrainer` builds ``[y_N-1, y_0, ..., y_N-2]`` within each
    batch; here over the split, so the pairs do not depend on the batching)."""
    n = len(records)
    return [{**r, "kl_completion": records[(i - 1) % n]["completion"]} for i, r in enumerate(records)]


class PreferenceEncoder(Encoder):
    """Batched ``Dataset.map`` function: preference or kto records -> the rows described above.

    Each conversation (prompt + completion) is rendered and tokenized whole, as `messages` data is;
    the trained tokens are those of the completion's assistant turns (the prompt's own assistant
    turns, in a multi-turn prompt, are not trained).
    """

    def __init__(self, tokenizer, fmt: str, max_len: int, template: str) -> None:
        super().__init__(tokenizer, "messages", max_len, template)
        self.pref_fmt = fmt

    def encode(
        self, prompts: list[list[dict]], completions: list[list[dict]]
    ) -> list[tuple[list[int], list[int], bool]]:
        """(input_ids, labels, truncated) of each prompt + completion, cut at max_len."""
        convs = [p + c for p, c in zip(prompts, completions)]
        texts = self._render(convs, False)
        enc = self.tok(texts, add_special_tokens=False, return_offsets_mapping=True)
        out = []
        for prompt, conv, full, ids, offsets in zip(prompts, convs, texts, enc["input_ids"], enc["offset_mapping"]):
            limit = offsets[self.max_len - 1][0] if len(ids) > self.max_len else len(full)
            in_prompt = sum(m["role"] == "assistant" for m in prompt)
            spans = self._spans(conv, full, limit)[in_prompt:]
            labels = span_labels(ids, offsets, spans, self.max_len)[: self.max_len]
            kept = ids[: self.max_len]
            labels[0] = IGNORE_INDEX
            out.append((kept, labels, len(ids) > self.max_len))
        return out

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        if not getattr(self.tok, "is_fast", False):
            from scaletune.errors import DataError

            raise DataError(
                f"format {self.pref_fmt} needs a fast (Rust) tokenizer for character offsets", title="invalid data"
            )
        prompts = batch["prompt"]
        sides = ("chosen", "rejected") if self.pref_fmt == "preference" else ("completion", "kl_completion")
        encoded = {side: self.encode(prompts, batch[side]) for side in sides}
        names = {"chosen": "chosen_", "rejected": "rejected_", "completion": "", "kl_completion": "kl_"}
        out: dict[str, list] = {f"{names[s]}{c}": [] for s in sides for c in ("input_ids", "labels")}
        out.update(index=[], truncated=[])
        if self.pref_fmt == "kto":
            out["desirable"] = []
        for i, index in enumerate(batch["index"]):
            rows = [encoded[s][i] for s in sides]
            # A side without a trained token cannot be scored; KTO's KL row is scored with the
            # policy only as an average, but it is kept to the same rule so no row is empty.
            if any(all(x == IGNORE_INDEX for x in labels) for _, labels, _ in rows):
                continue
            for side, (ids, labels, _) in zip(sides, rows):
                out[f"{names[side]}input_ids"].append(ids)
                out[f"{names[side]}labels"].append(labels)
            out["index"].append(index)
            out["truncated"].append(any(t for _, _, t in rows))
            if self.pref_fmt == "kto":
                out["desirable"].append(batch["label"][i])
        return out


def features(fmt: str) -> Any:
    """The `datasets.Features` of the rows of `fmt` (before `truncated` is dropped)."""
    import datasets

    ints = datasets.Sequence(datasets.Value("int32"))
    sides = ("chosen_", "rejected_") if fmt == "preference" else ("", "kl_")
    cols: dict[str, Any] = {f"{s}{c}": ints for s in sides for c in ("input_ids", "labels")}
    cols.update(index=datasets.Value("int64"), truncated=datasets.Value("bool"))
    if fmt == "kto":
        cols["desirable"] = datasets.Value("bool")
    return datasets.Features(cols)


def _pad(rows: list[list[int]], longest: int, value: int) -> torch.Tensor:
    out = torch.full((len(rows), longest), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r)
    return out


class PreferenceCollator:
    """Pads a micro-batch of m pairs into one ``[2m, T]`` batch: rows 0..m-1 the chosen answers,
    rows m..2m-1 the rejected ones (so one forward scores both: one parameter all-gather per layer
    under FSDP and ZeRO-3, not two). KTO: rows are the m completions, and the m KL rows come apart
    as ``kl_input_ids``/``kl_labels``/``kl_attention_mask`` (scored in the step's KL pass).

    Returns ``input_ids``, ``labels`` (-100 on padding), ``attention_mask``, ``position_ids``, ``index``
    ``[m]``; ``ref_logps`` ``[2m]`` (float32) where the rows carry precomputed reference log-probs
    (columns ``ref_chosen``/``ref_rejected``, kto ``ref``/``ref_kl``); kto adds ``desirable`` ``[m]``.
    """

    def __init__(self, pad_token_id: int, fmt: str) -> None:
        if pad_token_id is None:
            raise ValueError("PreferenceCollator needs a pad_token_id (the tokenizer's pad or eos token id)")
        self.pad, self.fmt = int(pad_token_id), fmt

    def _rows(self, ids: list[list[int]], labels: list[list[int]], prefix: str = "") -> dict[str, torch.Tensor]:
        longest = max(len(r) for r in ids)
        lengths = torch.tensor([len(r) for r in ids])
        mask = (torch.arange(longest)[None, :] < lengths[:, None]).long()
        return {
            f"{prefix}input_ids": _pad(ids, longest, self.pad),
            f"{prefix}labels": _pad(labels, longest, IGNORE_INDEX),
            f"{prefix}attention_mask": mask,
            f"{prefix}position_ids": torch.arange(longest).expand(len(ids), longest) * mask,
        }

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if self.fmt == "preference":
            ids = [r["chosen_input_ids"] for r in rows] + [r["rejected_input_ids"] for r in rows]
            labels = [r["chosen_labels"] for r in rows] + [r["rejected_labels"] for r in rows]
            out = self._rows(ids, labels)
            refs = ("ref_chosen", "ref_rejected")
        else:
            out = self._rows([r["input_ids"] for r in rows], [r["labels"] for r in rows])
            out.update(self._rows([r["kl_input_ids"] for r in rows], [r["kl_labels"] for r in rows], "kl_"))
            out["desirable"] = torch.tensor([bool(r["desirable"]) for r in rows])
            refs = ("ref", "ref_kl")
        out["index"] = torch.tensor([int(r["index"]) for r in rows])
        if refs[0] in rows[0]:
            out["ref_logps"] = torch.tensor(
                [r[refs[0]] for r in rows] + [r[refs[1]] for r in rows], dtype=torch.float32
            )
        return out
