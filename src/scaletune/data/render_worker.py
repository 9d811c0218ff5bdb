"""The child process that renders chat templates for `data.render` (run as a script, not imported
by scaletune: it imports transformers' renderer alone, so it starts in about a second).

A chat template is a program that came with a tokenizer or a config: transformers runs it in
Jinja's sandbox, which stops it from reaching Python objects but not from looping for hours or
building gigabytes (`'a' * 10**8 * 60`). Here each request renders under a time limit (an interval
timer whose signal interrupts the template between two bytecodes) and an address-space limit
(RLIMIT_AS, so an allocation past it is a MemoryError), and the parent holds its own deadline.

Protocol on stdin/stdout: frames of an 8-byte little-endian length and UTF-8 JSON. A request is
`{"template", "conversations", "add_generation_prompt", "tokens", "seconds", "memory"}`; the reply
`{"texts": [...]}` or `{"error": KIND, "message": ...}` with KIND one of `template` (Jinja's own
error), `time`, `memory`, `other`. After a time or memory error the worker exits.
"""

from __future__ import annotations

import json
import signal
import sys


class _OutOfTime(BaseException):
    """Raised by the interval timer; a BaseException so that no template-level handler swallows it."""


def _on_alarm(signum, frame):  # noqa: ARG001 - signal handler signature
    raise _OutOfTime


def _read(stream) -> dict | None:
    head = stream.read(8)
    if len(head) < 8:
        return None
    return json.loads(stream.read(int.from_bytes(head, "little")))


def _write(stream, obj: dict) -> None:
    data = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def _address_space() -> int:
    """This process's mapped bytes now (VmSize), or 0 where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _limit_memory(extra: int) -> None:
    try:
        import resource
    except ImportError:  # not a POSIX system: the parent's deadline still holds
        return
    base = _address_space()
    if base:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        soft = base + extra
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def main() -> None:
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template

    signal.signal(signal.SIGALRM, _on_alarm)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        request = _read(stdin)
        if request is None:
            return
        _limit_memory(int(request["memory"]))
        fatal = False
        try:
            signal.setitimer(signal.ITIMER_REAL, float(request["seconds"]))
            texts, _ = render_jinja_template(
                conversations=request["conversations"],
                chat_template=request["template"],
                add_generation_prompt=bool(request["add_generation_prompt"]),
                **request["tokens"],
            )
            signal.setitimer(signal.ITIMER_REAL, 0)
            reply = {"texts": texts}
        except _OutOfTime:
            reply, fatal = {"error": "time", "message": f"it did not finish within {request['seconds']:.0f} s"}, True
        except MemoryError:
            signal.setitimer(signal.ITIMER_REAL, 0)
            reply = {"error": "memory", "message": f"it needed more than {request['memory'] / 2**30:.1f} GiB"}
            fatal = True
        except jinja2.TemplateError as exc:
            signal.setitimer(signal.ITIMER_REAL, 0)
            reply = {"error": "template", "message": str(exc)}
        except Exception as exc:
            signal.setitimer(signal.ITIMER_REAL, 0)
            reply = {"error": "other", "message": f"{type(exc).__name__}: {exc}"}
        _write(stdout, reply)
        if fatal:
            return


if __name__ == "__main__":
    main()
