"""Dispatchers behind one small interface: where a job runs (`local`, `slurm`, `modal`)."""

from __future__ import annotations

from scaletune.serve.jobs.dispatch.base import Dispatcher, JobFiles, Status


def make_dispatchers(max_concurrent: int = 1) -> dict[str, Dispatcher]:
    from scaletune.serve.jobs.dispatch.local import LocalDispatcher
    from scaletune.serve.jobs.dispatch.modal import ModalDispatcher
    from scaletune.serve.jobs.dispatch.slurm import SlurmDispatcher

    return {
        "local": LocalDispatcher(max_concurrent=max_concurrent),
        "slurm": SlurmDispatcher(),
        "modal": ModalDispatcher(),
    }


__all__ = ["Dispatcher", "JobFiles", "Status", "make_dispatchers"]
