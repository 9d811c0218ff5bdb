"""The interactive conversation of `scaletune chat`: read a line, stream the answer, keep the
history; `/reset` forgets it, `/exit` (or end of input) ends."""

from __future__ import annotations

from collections.abc import Callable
from typing import TextIO

from scaletune.inference.generate import Sampling, stream
from scaletune.inference.loading import LoadedModel

HELP = "type a message; /reset forgets the conversation, /exit (or Ctrl-D) ends"


def chat_loop(
    loaded: LoadedModel,
    sampling: Sampling,
    *,
    read: Callable[[str], str],
    out: TextIO,
    system: str | None = None,
    image: str | None = None,
) -> int:
    """Converse until `/exit` or end of input; returns the number of answers given.

    Args:
        loaded: the model (:func:`~scaletune.inference.loading.load_for_inference`).
        sampling: decoding settings.
        read: returns the next user line given a prompt string (`input`); raises EOFError at the end.
        out: where answers are written as they stream.
        system: a system message opening the conversation (chat template only).
        image: an image file the first message of the conversation shows (a vision-language model;
            again after `/reset`).
    """
    opening = [{"role": "system", "content": system}] if system and loaded.template == "chat" else []
    conversation = list(opening)
    answers = 0
    while True:
        try:
            line = read("you> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return answers
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return answers
        if text == "/reset":
            conversation = list(opening)
            out.write("(conversation forgotten)\n")
            continue
        if text in ("/help", "/?"):
            out.write(HELP + "\n")
            continue
        content: str | list[dict] = text
        if image and not any(m["role"] == "user" for m in conversation):
            content = [{"type": "image", "path": image}, {"type": "text", "text": text}]
        conversation.append({"role": "user", "content": content})
        out.write("model> ")
        out.flush()

        def write(piece: str) -> None:
            out.write(piece)
            out.flush()

        answer = stream(loaded, conversation if loaded.template == "chat" else [conversation[-1]], sampling, write)
        out.write("\n")
        out.flush()
        conversation.append({"role": "assistant", "content": answer})
        answers += 1
