"""Chat templates rendered with time and memory bounds, in a child process of this one
(`render_worker.py`, started on first use and kept for the next renders).

A chat template comes with a tokenizer, a model folder or a run's config: a program from whoever
made them. Jinja's sandbox (transformers renders in it) keeps it away from Python objects, but a
template with nested loops never returns and one that builds `'a' * 10**8 * 60` allocates 6 GB.
Rendered in the child, such a template ends in a :class:`~scaletune.errors.DataError` (exit 2)
within :data:`SECONDS` (plus a second per MiB of input), and no allocation passes
:data:`MEMORY_BYTES` (plus 32 bytes per byte of input). The text rendered is transformers' own
`render_jinja_template`, the same as in this process.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from scaletune.errors import DataError

#: Seconds a render request may take, plus one per MiB of conversations.
SECONDS = 10.0
#: Bytes a render may allocate beyond what the worker holds, plus 32 per byte of conversations.
MEMORY_BYTES = 1 << 30
_WORKER = Path(__file__).with_name("render_worker.py")


def _worker_env() -> dict[str, str]:
    """The worker renders untrusted templates and needs nothing of its parent's environment: none of
    its secrets (a service's database URL and tokens, a user's HF_TOKEN), offline."""
    kept = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")}
    return {**kept, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def _inert(value: Any) -> str:
    # transformers replaces objects that are not plain JSON with such a placeholder as well.
    return f"<{type(value).__name__}>"


class _Worker:
    """One child process, started lazily, restarted after a failure or in a forked child."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.pid = 0
        self.lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        if self.proc is not None and self.pid == os.getpid() and self.proc.poll() is None:
            return self.proc
        if self.proc is not None and self.pid == os.getpid():
            self._stop()
        # -I: no PYTHONPATH, user site or current directory on its path (the venv's packages only).
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(_WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=_worker_env(),
        )
        self.pid = os.getpid()
        return self.proc

    def _stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def render(self, request: dict, deadline: float) -> dict:
        data = json.dumps(request, ensure_ascii=False, default=_inert).encode("utf-8", "surrogatepass")
        with self.lock:
            proc = self._start()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(len(data).to_bytes(8, "little") + data)
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], deadline)
                head = proc.stdout.read(8) if ready else b""
                body = proc.stdout.read(int.from_bytes(head, "little")) if len(head) == 8 else b""
            except OSError:
                head = body = b""
            if not body:
                timed_out = proc.poll() is None
                self._stop()
                if timed_out:
                    return {"error": "time", "message": f"it did not finish within {deadline:.0f} s"}
                return {"error": "memory", "message": "the renderer ended (out of memory?)"}
            reply = json.loads(body)
            if reply.get("error") in ("time", "memory"):
                self._stop()
            return reply


_worker = _Worker()


def render_bounded(
    template: str, conversations: list[list[dict]], add_generation_prompt: bool, tokens: dict[str, Any]
) -> list[str]:
    """`transformers.utils.chat_template_utils.render_jinja_template` of each conversation, in the
    worker, bounded in time and memory.

    Args:
        template: the Jinja chat template.
        conversations: lists of `{role, content}` turns.
        add_generation_prompt: end with the assistant's opening.
        tokens: template variables (the tokenizer's special tokens: `bos_token`, `eos_token`...).

    Raises:
        DataError: the template ran out of time or memory, or raised something other than a
            Jinja error.
        jinja2.TemplateError: the template's own error (undefined names, `raise_exception`),
            as transformers raises it.
    """
    import jinja2

    size = sum(len(m.get("content") or "") if isinstance(m, dict) else 0 for c in conversations for m in c)
    request = {
        "template": template,
        "conversations": conversations,
        "add_generation_prompt": add_generation_prompt,
        "tokens": tokens,
        "seconds": SECONDS + size / 2**20,
        "memory": MEMORY_BYTES + 32 * size,
    }
    reply = _worker.render(request, request["seconds"] + 10)
    if "texts" in reply:
        return reply["texts"]
    if reply["error"] == "template":
        raise jinja2.TemplateError(reply["message"])
    raise DataError(
        f"the chat template (data.chat_template, else the tokenizer's) was stopped: {reply['message']}. A chat "
        "template is a program that came with the tokenizer or the config; this one "
        + (
            "loops too long"
            if reply["error"] == "time"
            else "builds too much"
            if reply["error"] == "memory"
            else "fails"
        )
        + ": read it, and set data.chat_template to one you trust",
        title="invalid chat template",
    )
