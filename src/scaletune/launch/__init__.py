"""Launch builders (DESIGN.md): config and options in, argv + environment or script text out.

No torch import here: every function is pure (or writes/submits what a pure function built),
and tests compare its output.

* :mod:`.commands`: torchrun / deepspeed-launcher commands for one node
  (:func:`~.commands.build_launch`; :func:`~.commands.torchrun_argv`, the one torchrun command
  line, also used by the trainer's re-exec and the sbatch script).
* :mod:`.shell`: quoting and secret pass-through lines (:meth:`~.commands.LaunchCommand.script`
  renders the per-node launch script).
* :mod:`.slurm`: sbatch scripts (:func:`~.slurm.render_sbatch`, :func:`~.slurm.submit`).
* :mod:`.modal_app`: Modal apps (:func:`~.modal_app.render_modal_app`).
* :mod:`.presets`: NCCL / torch.distributed environment presets.
* :mod:`.configs`: standalone DeepSpeed JSON and FSDP configs for other trainers.
"""

from scaletune.launch.commands import (
    LaunchCommand,
    LaunchOptions,
    build_launch,
    single_node_torchrun_argv,
    torchrun_argv,
)
from scaletune.launch.presets import PRESETS, merged_env
from scaletune.launch.slurm import SlurmOptions, render_sbatch

__all__ = [
    "LaunchCommand",
    "LaunchOptions",
    "PRESETS",
    "SlurmOptions",
    "build_launch",
    "merged_env",
    "render_sbatch",
    "single_node_torchrun_argv",
    "torchrun_argv",
]
