"""`modal`: the app `launch.modal_app` generates, deployed and called with the Modal SDK's `spawn`
(checkpoints on the app's Modal Volume), watched and cancelled through the call's `FunctionCall`.

No Modal account is reachable from the machines this is tested on: the tests cover the app's
source and the SDK call up to Modal's answer (the authentication error); nothing here has run
on Modal itself.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import TYPE_CHECKING

import yaml

from scaletune.errors import UserError
from scaletune.serve.dispatch.base import Dispatcher, JobFiles, Status

if TYPE_CHECKING:
    from scaletune.launch.modal_app import ModalOptions

RESOURCE_KEYS = {"gpu_count", "gpu_type", "volume", "secrets", "timeout_hours"}


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

    r = job.resources
    # `options` converts with int(), which would take 1.5 GPUs as 1.
    count = r.get("gpu_count", 1)
    problems = [] if type(count) is int else [f"resources.gpu_count: must be a whole number, got {count!r}"]
    try:
        opts = options(job)
    except UserError as exc:  # unknown keys, named with the count
        raise UserError(exc.problems + problems, title="invalid resources") from None
    except (TypeError, ValueError):  # int() of the count named above
        if not problems:
            raise
    if problems:
        raise UserError(problems, title="invalid resources")
    validate(opts)
    return 1, opts.gpu_count, opts.gpu_count


def app_source(job: JobFiles) -> str:
    """The Modal app of a job (its config with overrides applied, inputs added to the image).

    Raises:
        UserError: unknown resource keys or invalid Modal options.
    """
    from scaletune.config import dump_config, load_config
    from scaletune.launch.modal_app import plan_inputs, render_modal_app

    opts = options(job)
    cfg = yaml.safe_load(dump_config(load_config(job.config_path, job.overrides)))
    plan = plan_inputs(cfg, job.workdir)
    dirs = frozenset(p for p in plan.mounts if os.path.isdir(p))
    return render_modal_app(opts, plan, dirs)


class ModalDispatcher(Dispatcher):
    name = "modal"

    def submit(self, job: JobFiles) -> str:
        import modal

        path = job.job_dir / "modal_app.py"
        path.write_text(app_source(job))
        spec = importlib.util.spec_from_file_location(f"scaletune_modal_{job.job_id}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        try:
            module.app.deploy()
            call = modal.Function.from_name(module.app.name, "train").spawn()
        except modal.exception.Error as exc:
            raise UserError(f"Modal refused the job: {exc} (run `modal token new` on the service's machine)") from None
        return call.object_id

    def poll(self, target_id: str, job: JobFiles) -> Status:
        import modal

        try:
            modal.FunctionCall.from_id(target_id).get(timeout=0)
        except TimeoutError:
            return Status("running")
        except modal.exception.Error:
            return Status("exited", 1)
        return Status("exited", 0)

    def stop(self, target_id: str, job: JobFiles) -> None:
        # The container cannot see the service's stop file; the periodic checkpoints on the volume
        # are what a resume starts from.
        self.cancel(target_id, job)

    def cancel(self, target_id: str, job: JobFiles) -> None:
        import modal

        modal.FunctionCall.from_id(target_id).cancel()
