"""The environment report of `scaletune doctor`: versions, GPUs, launcher, distributed variables,
and its rendering with the checks."""

from __future__ import annotations

import os
import platform
import shutil
import sys
from collections.abc import Mapping
from typing import Any

from scaletune import version_string
from scaletune.doctor.checks import installed_version
from scaletune.env import DistributedEnv

_PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "datasets",
    "accelerate",
    "deepspeed",
    "bitsandbytes",
    "liger-kernel",
    "safetensors",
)


def report(env: DistributedEnv, environ: Mapping[str, str] | None = None) -> dict:
    """Versions, GPUs, launcher and distributed variables of this process."""
    import torch

    e = os.environ if environ is None else environ
    out: dict[str, Any] = {
        "scaletune": version_string(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {p: installed_version(p) for p in _PACKAGES},
        "torch_cuda": torch.version.cuda,
        "nccl": None,
        "cuda_available": env.cuda_available,
        "gpus": [],
        "interconnect": None,
        "CUDA_VISIBLE_DEVICES": e.get("CUDA_VISIBLE_DEVICES"),
        "launcher": env.launcher,
        "rank": env.rank,
        "local_rank": env.local_rank,
        "world_size": env.world_size,
        "local_world_size": env.local_world_size,
        "distributed_vars": {
            k: e[k]
            for k in sorted(e)
            if k
            in (
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
                "TORCHELASTIC_RUN_ID",
            )
            or k.startswith(("NCCL_", "TORCH_NCCL_", "GLOO_", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID"))
        },
    }
    if env.cuda_available:
        try:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - a report, not a check
            pass
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out["gpus"].append(
                {"index": i, "name": p.name, "memory_bytes": int(p.total_memory), "capability": f"{p.major}.{p.minor}"}
            )
        if shutil.which("nvidia-smi"):
            import subprocess

            try:
                topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10)
                out["interconnect"] = topo.stdout.strip() or None
            except (OSError, subprocess.SubprocessError):
                pass
    return out


def render(rep: dict, results: list) -> Any:
    from rich.console import Group
    from rich.table import Table

    info = Table(title="environment", show_header=False)
    info.add_row("scaletune", rep["scaletune"])
    info.add_row("python", rep["python"])
    for k, v in rep["packages"].items():
        info.add_row(k, v or "not installed")
    info.add_row("torch CUDA / NCCL", f"{rep['torch_cuda'] or 'cpu build'} / {rep['nccl'] or '-'}")
    for g in rep["gpus"]:
        info.add_row(f"GPU {g['index']}", f"{g['name']}, {g['memory_bytes'] / 1024**3:.0f} GiB, sm {g['capability']}")
    if not rep["gpus"]:
        info.add_row("GPUs", "none visible")
    info.add_row("CUDA_VISIBLE_DEVICES", str(rep["CUDA_VISIBLE_DEVICES"]))
    info.add_row("launcher", f"{rep['launcher']} (rank {rep['rank']} of {rep['world_size']})")
    for k, v in rep["distributed_vars"].items():
        info.add_row(k, v)
    t = Table(title="checks")
    for col in ("check", "status", "message", "fix"):
        t.add_column(col)
    colors = {"OK": "green", "WARN": "yellow", "FAIL": "red"}
    for c in results:
        t.add_row(c.name, f"[{colors[c.status]}]{c.status}[/]", c.message, c.fix)
    return Group(info, t)
