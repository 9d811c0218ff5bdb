"""Prompts written as the model was trained, and answers generated in batches or streamed token by
token (`transformers`' `generate`, KV cache, left padding)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletune.data import alpaca_prompt, render_chat
from scaletune.data.sources import MAX_IMAGE_PIXELS, content_parts
from scaletune.errors import UserError
from scaletune.inference.loading import LoadedModel

if TYPE_CHECKING:
    from scaletune.inference.progress import PhaseProgress

# A prompt: plain text (one user turn) or a conversation of {role, content} turns.
Prompt = str | list[dict]


@dataclass(frozen=True)
class Sampling:
    """How answers are drawn.

    Attributes:
        max_new_tokens: longest answer, in tokens.
        temperature: 0 is greedy decoding (the same answer every time); above 0 samples from the
            softmax at that temperature.
        top_p: nucleus sampling's probability mass (with temperature > 0).
        seed: seeds torch before sampling, so a sampled answer can be reproduced.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 0.9
    seed: int = 0


def prompt_text(loaded: LoadedModel, prompt: Prompt) -> str:
    """The text the model sees before its answer.

    chat: the conversation (a string is one user turn) through the chat template with the
    generation prompt; alpaca: Stanford Alpaca's prompt around the last user turn; none: the text.
    """
    if loaded.template == "chat":
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return render_chat(loaded.tokenizer, loaded.chat_template, [turns], True)[0]
    text = prompt if isinstance(prompt, str) else next(m["content"] for m in reversed(prompt) if m["role"] == "user")
    return alpaca_prompt(text) if loaded.template == "alpaca" else text


def encode(loaded: LoadedModel, prompt: Prompt) -> list[int]:
    """Token ids of :func:`prompt_text`, as training tokenized them (special tokens added by the
    tokenizer only outside the chat template, which writes its own)."""
    text = prompt_text(loaded, prompt)
    return loaded.tokenizer(text, add_special_tokens=loaded.template != "chat")["input_ids"]


def stop_ids(loaded: LoadedModel) -> list[int]:
    """Tokens that end an answer: EOS, and the chat template's end of turn where it is one token."""
    tok = loaded.tokenizer
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if loaded.template == "chat":
        end = tok.convert_tokens_to_ids("<|im_end|>")
        if isinstance(end, int) and end != tok.unk_token_id and end not in ids:
            ids.append(end)
    return ids


def batch_inputs(loaded: LoadedModel, prompts: list[Prompt]) -> dict[str, Any]:
    """The model's inputs for `prompts`, left-padded so every answer starts at the same column:
    `input_ids` and `attention_mask` [B, T] (:func:`encode`'s tokens), and for a vision-language
    model its processor's image tensors of the prompts' image parts (`{"type": "image", "path"}`).

    Raises:
        UserError: an image that cannot be read.
    """
    import torch

    if loaded.processor is None:
        if any(not isinstance(p, str) and any(isinstance(m["content"], list) for m in p) for p in prompts):
            raise UserError(
                f"prompts with image parts need a vision-language model; {loaded.description.split(',')[0]} is a "
                "text model",
                title="invalid prompts",
            )
        ids = [encode(loaded, p) for p in prompts]
        width = max(len(x) for x in ids)
        pad = (
            loaded.tokenizer.pad_token_id
            if loaded.tokenizer.pad_token_id is not None
            else loaded.tokenizer.eos_token_id
        )
        return {
            "input_ids": torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=loaded.device),
            "attention_mask": torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=loaded.device),
        }
    from scaletune.data.sources import read_image
    from scaletune.data.vision import as_parts, image_paths

    conversations = [as_parts([{"role": "user", "content": p}] if isinstance(p, str) else p) for p in prompts]
    texts = [render_chat(loaded.tokenizer, loaded.chat_template, [c], True)[0] for c in conversations]
    images = []
    for c in conversations:
        try:
            images.append([read_image(path, MAX_IMAGE_PIXELS) for path in image_paths(c)])
        except ValueError as exc:
            raise UserError(f"image of a prompt: {exc}", title="invalid prompts") from None
    side = loaded.tokenizer.padding_side
    loaded.tokenizer.padding_side = "left"
    try:
        kwargs = {"images": images} if any(images) else {}
        batch = loaded.processor(text=texts, padding=True, return_tensors="pt", **kwargs)
    finally:
        loaded.tokenizer.padding_side = side
    return {k: v.to(loaded.device) for k, v in batch.items()}


def _generate_kwargs(loaded: LoadedModel, sampling: Sampling) -> dict[str, Any]:
    tok = loaded.tokenizer
    kw: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "eos_token_id": stop_ids(loaded),
        "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        "do_sample": sampling.temperature > 0,
    }
    if sampling.temperature > 0:
        kw.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
    else:  # greedy: clear the checkpoint's sampling defaults so transformers does not warn about them
        kw.update(temperature=None, top_p=None, top_k=None)
    return kw


def generate(
    loaded: LoadedModel,
    prompts: list[Prompt],
    sampling: Sampling,
    *,
    batch_size: int = 8,
    progress: PhaseProgress | None = None,
) -> list[str]:
    """One answer per prompt, in order; prompts are batched with left padding (the answer of
    each starts at the same column), which gives the same greedy answers as one at a time up to
    floating-point rounding. `progress` (sized `generation_steps`) advances once per generated
    position of each batch."""
    import torch

    answers: list[str] = []
    kw = _generate_kwargs(loaded, sampling)
    if progress is not None:
        from transformers import StoppingCriteria, StoppingCriteriaList

        class _Count(StoppingCriteria):  # called once per new position; stops nothing
            def __call__(self, input_ids: Any, scores: Any, **_: Any) -> Any:
                progress.advance()
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        kw["stopping_criteria"] = StoppingCriteriaList([_Count()])
    for start in range(0, len(prompts), batch_size):
        inputs = batch_inputs(loaded, prompts[start : start + batch_size])
        width = inputs["input_ids"].shape[1]
        torch.manual_seed(sampling.seed + start)
        with torch.no_grad():
            out = loaded.model.generate(**inputs, **kw)
        answers += [loaded.tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out]
    return answers


def generation_steps(prompts: int, sampling: Sampling, batch_size: int = 8) -> int:
    """The most positions :func:`generate` computes for `prompts` prompts: one per new token of each batch."""
    return -(-prompts // batch_size) * sampling.max_new_tokens


def stream(
    loaded: LoadedModel,
    conversation: list[dict],
    sampling: Sampling,
    write: Callable[[str], None],
    *,
    max_prompt_tokens: int | None = None,
    ready: Callable[[], None] = lambda: None,
) -> str:
    """Generate the assistant's next turn, passing text to `write` as tokens arrive; returns it whole.

    Args:
        max_prompt_tokens: refuse a conversation whose prompt is longer (None: any length): its
            prefill is one forward pass no stop request can interrupt.
        ready: called once the prompt is accepted, before the prefill.

    Raises:
        UserError: the prompt is over `max_prompt_tokens`.
    """
    import torch
    from transformers import TextStreamer

    class _Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            write(text)

    streamer = _Streamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True)
    inputs = batch_inputs(loaded, [conversation])
    width = inputs["input_ids"].shape[1]
    if max_prompt_tokens is not None and width > max_prompt_tokens:
        raise UserError(
            f"messages: the conversation is {width:,} tokens; this service answers up to "
            f"{max_prompt_tokens:,} (leave out earlier turns)",
            title="conversation too long",
        )
    ready()
    torch.manual_seed(sampling.seed)
    with torch.no_grad():
        out = loaded.model.generate(**inputs, streamer=streamer, **_generate_kwargs(loaded, sampling))
    return loaded.tokenizer.decode(out[0, width:], skip_special_tokens=True).strip()


def read_prompts(path: Path) -> list[Prompt]:
    """Prompts from a file: `.jsonl` (one object per line with `prompt` text or `messages` turns,
    or a JSON string), `.json` (a list of those), anything else one prompt per non-empty line. For a
    vision-language model a prompt may carry an `image` (a file relative to the prompts file) or
    `messages` with image parts, checked as training data's are (`data.sources.content_parts`).

    Raises:
        UserError: a missing file, bad JSON (file:line), an entry with neither field; every problem at once.
    """
    if not path.is_file():
        raise UserError(f"{path}: prompts file not found", title="invalid prompts")
    problems: list[str] = []
    prompts: list[Prompt] = []
    text = path.read_text(encoding="utf-8")

    def parts(content: list, where: str, role: str) -> list[dict]:
        found, errs = content_parts(content, where, path.parent, MAX_IMAGE_PIXELS, role=role)
        problems.extend(errs)
        return found

    def add(item: Any, where: str) -> None:
        if isinstance(item, str) and item.strip():
            prompts.append(item)
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str) and "image" in item:
            image = [{"type": "image", "path": item["image"]}, {"type": "text", "text": item["prompt"]}]
            prompts.append([{"role": "user", "content": parts(image, f"{where}: image", "user")}])
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append(item["prompt"])
        elif isinstance(item, dict) and isinstance(item.get("messages"), list) and item["messages"]:
            turns = item["messages"]
            if all(
                isinstance(m, dict) and isinstance(m.get("content"), str | list) and isinstance(m.get("role"), str)
                for m in turns
            ):
                prompts.append(
                    [
                        {
                            "role": m["role"],
                            "content": m["content"]
                            if isinstance(m["content"], str)
                            else parts(m["content"], f"{where}: messages[{j}].content", m["role"]),
                        }
                        for j, m in enumerate(turns)
                    ]
                )
            else:
                problems.append(f"{where}: messages must be {{role, content}} objects")
        else:
            problems.append(f"{where}: expected a string, {{'prompt': text}} or {{'messages': [...]}}")

    if path.suffix == ".jsonl":
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    add(json.loads(line), f"{path}:{lineno}")
                except json.JSONDecodeError as exc:
                    problems.append(f"{path}:{lineno}: not valid JSON: {exc.msg}")
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}", title="invalid prompts") from None
        if not isinstance(data, list):
            raise UserError(f"{path}: a .json prompts file holds a list", title="invalid prompts")
        for i, item in enumerate(data, 1):
            add(item, f"{path}: entry {i}")
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if problems:
        raise UserError(problems, title="invalid prompts")
    if not prompts:
        raise UserError(f"{path}: no prompts", title="invalid prompts")
    return prompts
