"""The service's one chat model: loaded once by `scaletune.inference` (as `scaletune chat RUN`
loads it: the run's prompt format, an adapter on its base, a checkpoint exported first by the
restricted loader, no remote code), reused while the same model is asked for, released when
another is. Generation runs in a worker thread; the tokens reach the event loop through a queue.

Besides the tuned model, a run's base answers (the page's side by side): a LoRA run's own model with
its adapter switched off while it answers (nothing else loaded), a full run's `model` section of
its config.yaml loaded as the trainer's "before training" samples load it (`load_model_config`),
both prompted as the run was trained."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class Choice:
    """The model that answers: its key in the slot, how it is loaded, whether its LoRA adapter is
    switched off while it answers (a LoRA run's base), how its description begins, and the `model`
    section's paths it reads besides the run's own files (a full run's base), which the caller checks
    against the service's policy first."""

    key: tuple
    load: Callable[[], Any]
    adapter_off: bool = False
    label: str = ""
    reads: dict[str, str] = field(default_factory=dict)


def tuned(target: Path) -> Choice:
    """The model at `target` (a run directory: its final/; or a checkpoint), as `scaletune chat` loads it."""
    from scaletune.inference import load_for_inference

    return Choice(model_key(target), lambda: load_for_inference(target))


def base(target: Path) -> Choice:
    """The model the run of `target` started from, prompted as the run was: a LoRA run's model with
    its adapter switched off (the slot keeps the one model: the tuned one and its base answer in
    turn without a load), a full run's `model.name_or_path` (and `model.tokenizer`) of its
    config.yaml, never with remote code.

    Raises:
        UserError: the target has no run config to name the base, or its model is a factory's.
    """
    from scaletune.inference.loading import find_target

    t = find_target(target)
    if t.adapter:
        return Choice(model_key(target), tuned(target).load, adapter_off=True, label="base (adapter off): ")
    cfg = t.run_config
    if cfg is None:
        raise UserError(f"{target}: no run config.yaml names the model this one was trained from", title="no base")
    if cfg.model.factory is not None:
        raise UserError(
            "model.factory: a factory's model is built by its own code, which the service does not run",
            title="no base",
        )
    name = str(cfg.model.name_or_path)
    folder = Path(name).expanduser()
    key = ("base", name, folder.stat().st_mtime_ns if folder.is_dir() else 0)

    def load() -> Any:
        import torch

        from scaletune.inference.loading import inference_dtype, load_model_config

        dtype = inference_dtype("auto", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        model = cfg.model.model_copy(update={"dtype": dtype, "trust_remote_code": False})
        return load_model_config(model, cfg.data, name=f"{name} (the base of this run)")

    reads = {"name_or_path": name, **({"tokenizer": cfg.model.tokenizer} if cfg.model.tokenizer else {})}
    return Choice(key, load, reads=reads)


async def answer(
    slot: ModelSlot, choice: Choice, conversation: list[dict], sampling: Any
) -> tuple[tuple, asyncio.Queue, threading.Event]:
    """Start answering `conversation` with the model `choice` names (:func:`tuned`, :func:`base`) in a
    worker thread. Returns once the model is loaded and the prompt accepted ("ready", description),
    or ("refused", UserError) / ("error", message) when either cannot be (a prompt over
    MAX_PROMPT_TOKENS is refused); then the queue holds ("token", text) items and one ("done",
    answer) or ("error", message). Set the event to stop early.
    """
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
        # peft's disable_adapter: the base layers alone answer, and the adapter is back on after.
        off = loaded.model.disable_adapter() if choice.adapter_off else contextlib.nullcontext()
        with off:
            text = stream(
                loaded,
                turns,
                sampling,
                write,
                max_prompt_tokens=MAX_PROMPT_TOKENS,
                ready=lambda: put(("ready", choice.label + loaded.description)),
            )
        put(("done", text))

    def run() -> None:
        try:
            slot.use(choice.key, choice.load, work)
        except Gone:
            put(("done", None))
        except UserError as exc:
            put(("refused", exc))
        except Exception as exc:  # noqa: BLE001 - the client is told; the service goes on
            log.exception("chat with %s failed", choice.key[0])
            put(("error", f"{type(exc).__name__}: {exc}"))

    threading.Thread(target=run, name="chat", daemon=True).start()
    first = await q.get()
    return first, q, gone
