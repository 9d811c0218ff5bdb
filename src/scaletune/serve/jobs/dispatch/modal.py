"""`modal`: the app `launch.modal_app` generates (its image installs scaletune's requirements),
deployed and called with the Modal SDK's `spawn` (checkpoints on the app's Modal Volume), watched,
settled and cancelled through the call's `FunctionCall`; its logs come from the call.

The job's report URL and token (and the secret values submitted with its config) reach the
function as a `modal.Secret.from_dict` made at submit time and attached with `with_options`:
never written into the app's source or any file.

The run directory is on the app's Modal Volume: `artifact` lists it and streams its files with the
SDK's `Volume.listdir` / `Volume.read_file`.

A submission is never spawned twice (two runs writing one run directory on the volume, twice the
GPUs), and a call Modal accepted is never recorded as a failed submit. Each submission has a
handle recorded before its `spawn`: the id of its own Function variant (`with_options` with the
Secret made for this submission makes a variant no other submission calls), written to
SPAWN_FILE, and the call id is written to CALL_FILE after the spawn. A spawn that raises (the
answer lost after Modal took the request, an SDK retry refused) and a service stopped during the
spawn are settled by asking Modal which calls that variant has (`reconcile`): the call is adopted
(calls a retried request made besides it are cancelled), or none is listed (the submit failed), or
Modal cannot be asked now (the job waits `submit unknown`; asked again).

No Modal account is reachable from the machines this is tested on: the tests cover the app's
source, the image, the Secret and the function the SDK would call, up to the network; nothing
here has run on Modal itself.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import posixpath
import shlex
import sys
import time
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING

import yaml

from scaletune.errors import UserError
from scaletune.serve.jobs.dispatch.base import (
    ArtifactMissing,
    ArtifactUnreachable,
    Dispatcher,
    Download,
    JobFiles,
    NotAccepted,
    Status,
    SubmitUnknown,
    checked_options,
)

if TYPE_CHECKING:
    import modal

    from scaletune.launch.modal_app import ModalOptions

log = logging.getLogger(__name__)
RESOURCE_KEYS = {"gpu_count", "gpu_type", "volume", "secrets", "timeout_hours"}
CALL_FILE = "modal-call"  # in the job folder: the call id (not a secret), what `logs` asks Modal by
# In the job folder, written just before `spawn` (JSON): `attempt`, the config.yaml's mtime (ns) of
# this start, so a marker left by an earlier run of a resumed job (resume rewrites config.yaml) is
# told from this one; `function`, the submission's Function variant, the calls are listed by;
# `since`, when; `error`, what the spawn raised, once it did. An older service wrote the mtime alone.
SPAWN_FILE = "modal-spawn"
LOG_ENTRIES = 5000  # the call's last log entries read for /logs (Modal keeps them; the SDK tails them)
LOOKUP_TAIL = 25  # the variant's last calls listed: one submission makes one (a few if the SDK retried)


def options(job: JobFiles) -> ModalOptions:
    """The Modal options of a job from its `resources` (gpu_count, gpu_type, volume, secrets,
    timeout_hours).

    Raises:
        UserError: unknown resource keys.
    """
    from scaletune.launch.modal_app import ModalOptions

    r = job.resources
    unknown = sorted(set(r) - RESOURCE_KEYS)
    if unknown:
        raise UserError([f"resources.{k}: unknown for target modal; known: {sorted(RESOURCE_KEYS)}" for k in unknown])
    return ModalOptions(
        gpu_count=int(r.get("gpu_count", 1)),
        gpu_type=str(r.get("gpu_type", "A10G")),
        app_name=f"scaletune-{job.job_id}",
        volume=str(r.get("volume", "scaletune-runs")),
        secrets=tuple(r.get("secrets", ())),
        timeout_hours=float(r.get("timeout_hours", 24)),
    )


def shape(job: JobFiles) -> tuple[int, int, int]:
    """(nodes, GPUs per node, world size) of the job: one container of `gpu_count` GPUs with a rank
    on each (the app runs torchrun over them when there are several).

    Raises:
        UserError: the options `render_modal_app` refuses (every problem).
    """
    from scaletune.launch.modal_app import validate

    opts = checked_options(job, options, ("gpu_count",))
    validate(opts)
    return 1, opts.gpu_count, opts.gpu_count


def app_source(job: JobFiles) -> str:
    """The Modal app of a job (its config with overrides applied, inputs added to the image, the
    image installing scaletune's requirements as `scaletune modal` lists them).

    Raises:
        UserError: unknown resource keys or invalid Modal options.
    """
    from dataclasses import replace

    from scaletune.config import dump_config, load_config
    from scaletune.launch.modal_app import image_requirements, plan_inputs, render_modal_app

    opts = options(job)
    cfg = yaml.safe_load(dump_config(load_config(job.config_path, job.overrides)))
    opts = replace(opts, requirements=image_requirements((cfg.get("distributed") or {}).get("strategy") or "auto"))
    plan = plan_inputs(cfg, job.workdir)
    dirs = frozenset(p for p in plan.mounts if os.path.isdir(p))
    return render_modal_app(opts, plan, dirs)


def load_app(job: JobFiles) -> ModuleType:
    """The job's app written to its folder (`modal_app.py`, no secret in it) and imported: its
    `app`, `image` and `train` are the Modal SDK's objects (nothing is sent until deploy)."""
    path = job.job_dir / "modal_app.py"
    path.write_text(app_source(job))
    spec = importlib.util.spec_from_file_location(f"scaletune_modal_{job.job_id}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def job_secret(job: JobFiles) -> modal.Secret:
    """The job's environment (report URL, report token, secret values submitted with its config)
    as a Modal Secret made now: it goes to Modal with the call, never into a file."""
    import modal

    return modal.Secret.from_dict(dict(job.env))


def train_function(job: JobFiles) -> modal.Function:
    """The deployed app's `train` as this job calls it: with the job's Secret besides the named
    ones (`with_options` replaces the function's secrets, so those are given again)."""
    import modal

    opts = options(job)
    named = [modal.Secret.from_name(s) for s in opts.secrets]
    return modal.Function.from_name(opts.app_name, "train").with_options(secrets=[*named, job_secret(job)])


def outcome(call: modal.FunctionCall) -> Status:
    """How a call stands, from its result (`FunctionCall.get(timeout=0)`): the app's `train` returns
    {"exit_code", "final"}; an exception it raised, a timeout or a cancel is a failure; an answer
    Modal could not give now (network, authentication) says nothing of the call."""
    import modal

    try:
        result = call.get(timeout=0)
    except modal.exception.OutputExpiredError:  # Modal no longer keeps it: how it ended is unknown
        return Status("exited", None)
    except modal.exception.FunctionTimeoutError:
        return Status("exited", 1)
    except (TimeoutError, modal.exception.TimeoutError):  # no output yet
        return Status("running")
    except (modal.exception.ConnectionError, modal.exception.AuthError, modal.exception.ServiceError):
        return Status("ending")  # not known now; asked again at the next poll
    except Exception:  # noqa: BLE001 - whatever the function raised, re-raised here by the SDK
        return Status("exited", 1)
    if isinstance(result, dict) and isinstance(result.get("exit_code"), int):
        return Status("exited", result["exit_code"], final=bool(result.get("final")))
    return Status("exited", None)


class ModalDispatcher(Dispatcher):
    name = "modal"
    slow = True  # sbatch / squeue / scancel, or Modal over the network

    # How long an artifact request waits for Modal's listing: the SDK itself retries a connection
    # for about a minute, too long for an HTTP request.
    volume_timeout_s = 20.0

    # How long Modal must list no call of a submission whose spawn raised before it counts as not
    # accepted (a listing read at the instant of a lost answer is not taken as the last word).
    settle_s = 10.0
    # How long a submission whose outcome is not known is asked about; then the job fails `lost`.
    reconcile_for_s = 900.0
    lookup_timeout_s = 20.0  # one listing of the calls (the SDK itself retries for about a minute)

    def submit(self, job: JobFiles) -> str:
        """Deploy the job's app and spawn its `train`; returns the call id.

        Raises:
            UserError: Modal refused the deploy or the Function (no credentials, ...), or it lists
                no call of this submission after its spawn raised (`NotAccepted`).
            SubmitUnknown: the spawn raised and Modal cannot be asked now whether it took the call.
        """
        import modal

        module = load_app(job)
        for name in (CALL_FILE, SPAWN_FILE):  # a resumed job's folder holds its last run's
            (job.job_dir / name).unlink(missing_ok=True)
        try:
            module.app.deploy()  # a second deploy of the same app is harmless; a second spawn is not
            function = train_function(job)
            function.hydrate()  # the submission's own variant: its id is the handle its calls are listed by
        except modal.exception.Error as exc:
            why = _scrubbed(str(exc), job)
            raise UserError(f"Modal refused the job: {why} (run `modal token new` on the service's machine)") from None
        mark = {"attempt": _attempt(job), "function": function.object_id, "since": time.time()}
        _write(job.job_dir / SPAWN_FILE, json.dumps(mark))
        try:
            call_id = function.spawn().object_id
        except Exception as exc:  # noqa: BLE001 - whatever the SDK raised, Modal may have taken the call first
            error = _scrubbed(f"{type(exc).__name__}: {exc}", job)[:500]
            _write(job.job_dir / SPAWN_FILE, json.dumps({**mark, "error": error}))
            return self.reconcile(job)
        _write(job.job_dir / CALL_FILE, call_id)
        return call_id

    def adopt(self, job: JobFiles) -> str | None:
        """After a restart that found the job `starting`: the call `submit` spawned (CALL_FILE); None
        when this start never reached `spawn` (deployed again and spawned then).

        Raises:
            SubmitUnknown: the last service stopped during `spawn` (SPAWN_FILE of this start, no call
                id): Modal is asked which call it took (`reconcile`); it is not spawned a second time.
        """
        if _marker(job) is None:
            return None  # none, or an earlier run's (a resumed job): this start did not spawn
        call_id = _call_file(job)
        if call_id:
            return call_id
        raise SubmitUnknown(
            f"the last service stopped while spawning this job on Modal (app {options(job).app_name}): "
            "Modal is asked which call it took; the job is not spawned a second time"
        )

    def reconcile(self, job: JobFiles) -> str:
        """The call of this start whose spawn raised or was cut off, looked up at Modal by the
        submission's Function variant (SPAWN_FILE): written to CALL_FILE and returned; calls listed
        besides it (the SDK retries a spawn whose answer was lost, and each try Modal took is a
        call) are cancelled, the first kept.

        Raises:
            SubmitUnknown: Modal cannot be asked now, or lists no call yet (within `settle_s`).
            NotAccepted: Modal lists no call of the submission: the submit failed.
            UserError: it cannot be told (a marker without the variant, written by an older
                service, or Modal not answering for `reconcile_for_s`): the job fails, never
                spawned a second time.
        """
        import modal

        mark = _marker(job) or {}
        if not mark:
            raise NotAccepted("this start of the job did not reach Modal's spawn")
        call_id = _call_file(job)
        if call_id:
            return call_id
        function, since = mark.get("function"), float(mark.get("since") or 0)
        if not function:
            raise UserError(_unknown(job, None))
        try:
            calls = calls_of(function, self.lookup_timeout_s)
        except Exception as exc:  # noqa: BLE001 - no answer from Modal is no news of the call
            if time.time() - since > self.reconcile_for_s:
                raise UserError(_unknown(job, function)) from None
            raise SubmitUnknown(
                f"Modal's answer to the spawn was lost ({mark.get('error') or 'the service stopped'}) and Modal "
                f"cannot be asked now which call it took ({type(exc).__name__}): asked again"
            ) from None
        if not calls:
            if time.time() - since < self.settle_s:
                raise SubmitUnknown(f"the spawn raised ({mark.get('error')}); Modal lists no call of it yet")
            raise NotAccepted(
                f"Modal did not take the job ({mark.get('error') or 'the service stopped during the spawn'}): "
                f"it lists no call of this submission (`modal function calls {function}`)"
            )
        keep, extra = calls[-1], calls[:-1]  # listed newest first: the first call Modal took is kept
        for other in extra:
            try:
                modal.FunctionCall.from_id(other).cancel()
            except modal.exception.Error:
                log.warning("job %s: Modal call %s (a retried spawn's) could not be cancelled", job.job_id, other)
        log.warning(
            "job %s: the spawn raised (%s) but Modal took call %s: adopted (%d more cancelled)",
            job.job_id, mark.get("error") or "the service stopped", keep, len(extra),
        )  # fmt: skip
        _write(job.job_dir / CALL_FILE, keep)
        return keep

    def poll(self, target_id: str, job: JobFiles) -> Status:
        import modal

        return outcome(modal.FunctionCall.from_id(target_id))

    def stop(self, target_id: str, job: JobFiles) -> None:
        # The container cannot see the service's stop file; the periodic checkpoints on the volume
        # are what a resume starts from.
        self.cancel(target_id, job)

    def cancel(self, target_id: str, job: JobFiles) -> None:
        import modal

        if target_id:  # none while a submission's outcome is not known: `reconcile` cancels what it finds
            modal.FunctionCall.from_id(target_id).cancel()

    def log_bytes(self, job: JobFiles, offset: int | None = None, limit: int = 1 << 20) -> bytes:
        """The call's output as Modal keeps it (`FunctionCall.logs.tail`, UTF-8); nothing on this
        machine holds it. Empty before the call exists or when Modal cannot be asked now."""
        import modal

        try:
            call_id = (job.job_dir / CALL_FILE).read_text().strip()
        except OSError:
            return b""
        try:
            entries = list(modal.FunctionCall.from_id(call_id).logs.tail(entries=LOG_ENTRIES))
        except modal.exception.Error:
            return b""
        text = "".join(e.message for e in entries).encode()
        start = max(0, len(text) - limit) if offset is None else min(offset, len(text))
        return text[start : start + limit]

    def volume(self, name: str) -> modal.Volume:
        """The named Modal Volume (hydrated by its first call)."""
        import modal

        return modal.Volume.from_name(name)

    def artifact(self, job: JobFiles, run_dir: str, rel: str) -> list[str] | Download:
        """The artifact from the job's Modal volume: `listdir(recursive=True)` of `RUN/rel` says
        whether it is one file (then streamed with `read_file`) or a folder (its files listed). An
        empty listing is a missing artifact (the volume keeps no folder the run did not fill).

        Raises:
            ArtifactMissing: not on the volume (yet), or a name Modal reads as a glob.
            ArtifactUnreachable: Modal not asked in `volume_timeout_s`, no credentials, refused.
        """
        import modal

        where = volume_path(job, run_dir)
        base, want = where["path"], f"{where['path']}/{rel}"
        if "*" in rel:  # Modal's listdir reads a trailing `*` as a glob
            raise ArtifactMissing("not an artifact of this run")

        def unreachable(why: str) -> ArtifactUnreachable:
            # Only our words and the volume's names: an SDK message is not repeated (no secret).
            fetch = f"modal volume get {shlex.quote(where['volume'])} {shlex.quote(want)}"
            return ArtifactUnreachable(
                f"{rel}: on the Modal volume {where['volume']} under {want}, which {why}; fetch it with `{fetch}`"
            )

        try:
            vol = self.volume(where["volume"])
            entries = asyncio.run(asyncio.wait_for(vol.listdir.aio(want, recursive=True), self.volume_timeout_s))
        except (modal.exception.NotFoundError, FileNotFoundError):
            raise ArtifactMissing(f"{rel}: not written (yet)") from None
        except TimeoutError:
            raise unreachable(f"Modal did not list in {self.volume_timeout_s:g} s") from None
        except modal.exception.AuthError:
            raise unreachable(
                "Modal refused to list (credentials: `modal token new` on the service's machine)"
            ) from None
        except (modal.exception.Error, OSError) as exc:
            raise unreachable(f"could not be listed ({type(exc).__name__})") from None
        file_type = modal.volume.FileEntryType.FILE
        if len(entries) == 1 and entries[0].path.strip("/") == want and entries[0].type == file_type:
            return Download(
                posixpath.basename(want), chunks=self._stream(vol, want, rel, unreachable), size=entries[0].size
            )
        prefix = base + "/"
        # Files only (links and folders are not served), named from the run directory.
        found = sorted(
            e.path.strip("/")[len(prefix) :]
            for e in entries
            if e.type == file_type and e.path.strip("/").startswith(f"{want}/")
        )
        if not found:
            raise ArtifactMissing(f"{rel}: not written (yet)")
        return found

    def _stream(self, vol, path: str, rel: str, unreachable) -> Iterator[bytes]:
        """`read_file`'s chunks; its first one asked now, so that a refusal is still an answer (404,
        502) rather than a response cut short."""
        import modal

        chunks = iter(vol.read_file(path))
        try:
            first = next(chunks, b"")
        except (modal.exception.NotFoundError, FileNotFoundError):
            raise ArtifactMissing(f"{rel}: not written (yet)") from None
        except (modal.exception.Error, OSError) as exc:
            raise unreachable(f"could not be read ({type(exc).__name__})") from None

        def rest() -> Iterator[bytes]:
            if first:
                yield first
            yield from chunks

        return rest()


def calls_of(function_id: str, timeout_s: float) -> list[str]:
    """The ids of the calls Modal lists for the Function (or variant) `function_id`, newest first:
    its recent inputs, as `modal function calls FUNCTION_ID` lists them (the SDK's client and the
    request that command sends; the SDK has no public call for it).

    Raises:
        Exception: what the SDK raises when Modal cannot be asked (TimeoutError after `timeout_s`).
    """
    from modal._utils.async_utils import synchronizer
    from modal.client import _Client
    from modal_proto import api_pb2

    async def fetch() -> list[str]:
        client = await _Client.from_env()
        tail = api_pb2.FunctionCallFetchRequest.Tail(count=LOOKUP_TAIL)
        answer = await client._stub.FunctionCallFetch(
            api_pb2.FunctionCallFetchRequest(function_id=function_id, tail=tail)
        )
        return list(dict.fromkeys(c.function_call_id for c in answer.function_call_inputs if c.function_call_id))

    async def bounded() -> list[str]:
        return await asyncio.wait_for(fetch(), timeout_s)

    return synchronizer.create_blocking(bounded)()


def _marker(job: JobFiles) -> dict | None:
    """This start's SPAWN_FILE (None: none, or an earlier run's)."""
    try:
        text = (job.job_dir / SPAWN_FILE).read_text().strip()
    except OSError:
        return None
    try:
        mark = json.loads(text) if text.startswith("{") else {"attempt": text}
    except ValueError:
        mark = {"attempt": ""}
    return mark if mark.get("attempt") == _attempt(job) else None


def _scrubbed(text: str, job: JobFiles) -> str:
    """`text` (an SDK's message, kept on the record and in the job folder) with each value of the
    job's environment (its report token, its secrets) hidden, should the SDK ever repeat one."""
    for value in job.env.values():
        if len(value) >= 4:
            text = text.replace(value, "***")
    return text


def _call_file(job: JobFiles) -> str:
    try:
        return (job.job_dir / CALL_FILE).read_text().strip()
    except OSError:
        return ""


def _unknown(job: JobFiles, function: str | None) -> str:
    app = options(job).app_name
    listed = f"`modal function calls {function}` / " if function else ""
    return (
        f"whether this job's call on Modal started is unknown (app {app}), so it is not started again: see "
        f"{listed}`modal app logs {app}` (`modal app stop {app}` ends a call left running), then resume the job"
    )


def _attempt(job: JobFiles) -> str:
    """This start of the job, as SPAWN_FILE records it: config.yaml's mtime in ns (written at
    submit and at every resume, before the job can start)."""
    return str(job.config_path.stat().st_mtime_ns)


def _write(path, text: str) -> None:
    """`text` written whole or not at all (a restart never reads half a call id)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def volume_path(job: JobFiles, run_dir: str) -> dict[str, str]:
    """Where a Modal job's run directory is: on its Modal volume, not on this machine (fetch it
    with `modal volume get VOLUME PATH`)."""
    from scaletune.launch.modal_app import volume_run_name

    volume, path = options(job).volume, volume_run_name(run_dir)
    return {"volume": volume, "path": path, "fetch": f"modal volume get {volume} {path}"}
