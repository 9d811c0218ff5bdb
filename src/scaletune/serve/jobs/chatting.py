"""The service's one chat model: loaded once by `scaletune.inference` (as `scaletune chat RUN`
loads it: the run's prompt format, an adapter on its base, a checkpoint exported first by the
restricted loader, no remote code), reused while the same model is asked for, released when
another is. Generation runs in a worker thread; the tokens reach the event loop through a queue."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletune.errors import UserError

log = logging.getLogger(__name__)


class Gone(Exception):
    """The client went away: raised from the streamer to end the generation."""


# The longest prompt a chat turn may have, in tokens: its prefill holds the one model slot (every
# other chat waits) and cannot be stopped when the client leaves, so it is bounded (issue 34: 200
# turns of 32,000 characters kept the slot for a minute after the client had gone).
MAX_PROMPT_TOKENS = 4096


class ModelSlot:
    """At most one model in memory; one generation at a time on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._loaded: Any = None

    @property
    def key(self) -> tuple | None:
        return self._key

    def use(self, key: tuple, load: Callable[[], Any], work: Callable[[Any], None]) -> None:
        """`work(model)` with the model `key` names, loading it by `load()` first unless it is the
        one held (the one held is released before: two never sit in memory together)."""
        with self._lock:
            if self._key != key:
                self._key, self._loaded = None, None
                _release()
                self._loaded = load()
                self._key = key
            work(self._loaded)


def _release() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass


def model_key(target: Path) -> tuple:
    """What tells one model from another: its path and the time its folder last changed (a
    resumed run writes a new final/)."""
    folder = target / "final" if (target / "final").is_dir() else target
    return (str(target), folder.stat().st_mtime_ns)


async def answer(
    slot: ModelSlot, target: Path, conversation: list[dict], sampling: Any
) -> tuple[tuple, asyncio.Queue, threading.Event]:
    """Start answering `conversation` with the model at `target` (a run directory: its final/; or a
    checkpoint) in a worker thread. Returns once the model is loaded and the prompt accepted
    ("ready", description), or ("refused", UserError) / ("error", message) when either cannot be (a
    prompt over MAX_PROMPT_TOKENS is refused); then the queue holds ("token", text) items and one
    ("done", answer) or ("error", message). Set the event to stop early.
    """
    from scaletune.inference import load_for_inference
    from scaletune.inference.generate import stream

    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    gone = threading.Event()

    def put(item: tuple) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the service is stopping, nobody listens
            gone.set()

    def work(loaded: Any) -> None:
        def write(piece: str) -> None:
            if gone.is_set():
                raise Gone
            if piece:
                put(("token", piece))

        # Without the chat template the model sees the last user turn only, as `scaletune chat`.
        turns = conversation if loaded.template == "chat" else [conversation[-1]]
        text = stream(
            loaded,
            turns,
            sampling,
            write,
            max_prompt_tokens=MAX_PROMPT_TOKENS,
            ready=lambda: put(("ready", loaded.description)),
        )
        put(("done", text))

    def run() -> None:
        try:
            slot.use(model_key(target), lambda: load_for_inference(target), work)
        except Gone:
            put(("done", None))
        except UserError as exc:
            put(("refused", exc))
        except Exception as exc:  # noqa: BLE001 - the client is told; the service goes on
            log.exception("chat with %s failed", target)
            put(("error", f"{type(exc).__name__}: {exc}"))

    threading.Thread(target=run, name="chat", daemon=True).start()
    first = await q.get()
    return first, q, gone
