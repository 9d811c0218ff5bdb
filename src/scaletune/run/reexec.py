"""Re-executing `scaletune train` under torchrun: one process per wanted device on this machine,
secrets through the environment only."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from scaletune.env import cpu_budget, print0
from scaletune.resolve import RunSpec


def reexec_under_torchrun(spec: RunSpec, config_path: Path | str, overrides: list[str]) -> None:
    """Replace this process by torchrun starting `spec.world_size` ranks on this machine, each with
    `distributed.env` set."""
    from scaletune.config import public_overrides
    from scaletune.launch.commands import single_node_torchrun_argv
    from scaletune.launch.presets import merged_env, split_secrets

    d = spec.config.distributed
    # Secret values reach the ranks through their environment, never their command line or a log.
    argv = single_node_torchrun_argv(
        sys.executable, spec.world_size, [str(config_path), *public_overrides(overrides, d.secret_env)]
    )
    env = merged_env(d.env)
    if spec.env.device_type == "cpu" and "OMP_NUM_THREADS" not in {**os.environ, **env}:
        # torchrun would give each rank 1 thread; the cores this process may use, split between them.
        env["OMP_NUM_THREADS"] = str(cpu_budget(spec.world_size).threads)
    public, secrets = split_secrets(env, d.secret_env)
    shown = " ".join(f"{k}={v}" for k, v in public.items()) + "".join(f" {k}=<secret>" for k in secrets)
    print0(f"[scaletune] starting {spec.world_size} processes:{' ' + shown if shown else ''} {' '.join(argv)}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, {**os.environ, **env})
