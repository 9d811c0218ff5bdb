"""The default process group: started for a launched job (NCCL on GPUs, gloo on CPUs), or as a
group of one for engines that need one; and a free loopback port."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from scaletune.env import DistributedEnv


def init_process_group(
    env: DistributedEnv, backend: str = "auto", timeout_minutes: float = 30, *, even_alone: bool = False
) -> bool:
    """Start the default process group for a launched multi-rank job: NCCL on CUDA, gloo on CPU.

    `even_alone`: also start a group of one for a plain single process (FSDP and DeepSpeed need a
    group at world size 1), on a free loopback port.

    Returns True if this call created it (and so must destroy it).

    Raises:
        RuntimeError: the launcher did not set MASTER_ADDR/MASTER_PORT; NCCL without a GPU.
    """
    if dist.is_initialized() or not (env.is_distributed or even_alone):
        return False
    if not env.is_distributed and not env.launched:
        # What a launcher would have set; DeepSpeed reads LOCAL_RANK itself.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        for var in ("RANK", "LOCAL_RANK"):
            os.environ.setdefault(var, "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    if backend == "auto":
        backend = "nccl" if env.cuda_available else "gloo"
    if backend == "nccl" and not env.cuda_available:
        raise RuntimeError("distributed.backend nccl needs CUDA GPUs; use gloo (or auto) on CPU")
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(f"{var} is not set: start multi-rank runs with torchrun, deepspeed or scaletune launch")
    if env.cuda_available:
        torch.cuda.set_device(env.device)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = env.device  # binds the communicator to this rank's GPU up front
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps one store across restarts: without a per-attempt prefix, restarted ranks
        # read the addresses the killed ranks published and gloo fails with "connectFullMesh ...
        # Connection refused" (pytorch#167288).
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        kwargs["store"] = dist.PrefixStore(f"scaletune/attempt-{attempt}", store)
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs)
    return True


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
