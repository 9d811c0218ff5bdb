"""Dispatchers behind one small interface: where a job runs (`local`, `slurm`, `modal`)."""

from __future__ import annotations

from scaletune.serve.dispatch.base import Dispatcher, JobFiles, Status


def make_dispatchers(max_concurrent: int = 1) -> dict[str, Dispatcher]:
    from scaletune.serve.dispatch.local import LocalDispatcher
    from scaletune.serve.dispatch.modal import ModalDispatcher
    from scaletune.serve.dispatch.slurm import SlurmDispatcher

    return {
        "local": LocalDispatcher(max_concurrent=max_concurrent),
        "slurm": SlurmDispatcher(),
        "modal": ModalDispatcher(),
    }


__all__ = ["Dispatcher", "JobFiles", "Status", "make_dispatchers"]
