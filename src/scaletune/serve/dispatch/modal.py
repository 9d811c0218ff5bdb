"""`modal`: the app `launch.modal_app` generates (its image installs scaletune's requirements),
deployed and called with the Modal SDK's `spawn` (checkpoints on the app's Modal Volume), watched,
settled and cancelled through the call's `FunctionCall`; its logs come from the call.

The job's report URL and token (and the secret values submitted with its config) reach the
function as a `modal.Secret.from_dict` made at submit time and attached with `with_options`:
never written into the app's source or any file.

No Modal account is reachable from the machines this is tested on: the tests cover the app's
source, the image, the Secret and the function the SDK would call, up to the network; nothing
here has run on Modal itself.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING

import yaml

from scaletune.errors import UserError
from scaletune.serve.dispatch.base import Dispatcher, JobFiles, Status, checked_options

if TYPE_CHECKING:
    import modal

    from scaletune.launch.modal_app import ModalOptions

RESOURCE_KEYS = {"gpu_count", "gpu_type", "volume", "secrets", "timeout_hours"}
CALL_FILE = "modal-call"  # in the job folder: the call id (not a secret), what `logs` asks Modal by
LOG_ENTRIES = 5000  # the call's last log entries read for /logs (Modal keeps them; the SDK tails them)


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

    def submit(self, job: JobFiles) -> str:
        import modal

        module = load_app(job)
        try:
            module.app.deploy()
            call = train_function(job).spawn()
        except modal.exception.Error as exc:
            raise UserError(f"Modal refused the job: {exc} (run `modal token new` on the service's machine)") from None
        (job.job_dir / CALL_FILE).write_text(call.object_id + "\n")
        return call.object_id

    def poll(self, target_id: str, job: JobFiles) -> Status:
        import modal

        return outcome(modal.FunctionCall.from_id(target_id))

    def stop(self, target_id: str, job: JobFiles) -> None:
        # The container cannot see the service's stop file; the periodic checkpoints on the volume
        # are what a resume starts from.
        self.cancel(target_id, job)

    def cancel(self, target_id: str, job: JobFiles) -> None:
        import modal

        modal.FunctionCall.from_id(target_id).cancel()

    def logs(self, job: JobFiles, offset: int | None = None, limit: int = 1 << 20) -> str:
        """The call's output as Modal keeps it (`FunctionCall.logs.tail`); nothing on this machine
        holds it. Empty before the call exists or when Modal cannot be asked now."""
        import modal

        try:
            call_id = (job.job_dir / CALL_FILE).read_text().strip()
        except OSError:
            return ""
        try:
            entries = list(modal.FunctionCall.from_id(call_id).logs.tail(entries=LOG_ENTRIES))
        except modal.exception.Error:
            return ""
        text = "".join(e.message for e in entries).encode()
        start = max(0, len(text) - limit) if offset is None else min(offset, len(text))
        return text[start : start + limit].decode(errors="replace")


def volume_path(job: JobFiles, run_dir: str) -> dict[str, str]:
    """Where a Modal job's run directory is: on its Modal volume, not on this machine (fetch it
    with `modal volume get VOLUME PATH`)."""
    from scaletune.launch.modal_app import volume_run_name

    volume, path = options(job).volume, volume_run_name(run_dir)
    return {"volume": volume, "path": path, "fetch": f"modal volume get {volume} {path}"}
