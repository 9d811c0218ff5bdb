"""How this process was launched, read once from the environment; rank-0 printing and logging.

`DistributedEnv.from_environ()` recognises:

* torchrun / torch.distributed.run: `TORCHELASTIC_RUN_ID` with `RANK`, `LOCAL_RANK`, `WORLD_SIZE`
* the deepspeed launcher: `CROSS_RANK`/`LOCAL_SIZE` with `RANK`, `LOCAL_RANK`, `WORLD_SIZE`
* srun with one task per rank: `SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NTASKS` (only when the
  torch variables are absent: under `srun torchrun ...`, torchrun is the launcher)
* none: a plain process, world size 1

Other launchers that set the torch variables (`RANK`, `WORLD_SIZE`, ...) are reported as
`env`; scaletune treats them like torchrun.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Launcher = Literal["torchrun", "deepspeed", "srun", "env", "none"]

# The variables whose presence means "a launcher started this process": device_map and the
# stale-variable check in doctor read this list.
DISTRIBUTED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise RuntimeError(f"environment variable {name}={raw!r} is not an integer") from exc


@dataclass(frozen=True)
class DistributedEnv:
    """The process's place in the job.

    Attributes:
        launcher: what started the process (see module docstring).
        rank: global rank, 0..world_size-1.
        local_rank: rank within this node; selects the GPU.
        world_size: number of ranks in the job.
        local_world_size: ranks on this node.
        master_addr, master_port: the rendezvous address, where the launcher set one.
        cuda_available, cuda_device_count: what torch sees (after CUDA_VISIBLE_DEVICES).
        device_memory_bytes: total memory of this rank's GPU; None without one (or not probed).
        bf16_supported: this rank's GPU computes in bfloat16 (`torch.cuda.is_bf16_supported()`).
        restart_count: how often torchrun restarted the workers (`TORCHELASTIC_RESTART_COUNT`).
    """

    launcher: Launcher
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    cuda_available: bool = False
    cuda_device_count: int = 0
    device_memory_bytes: int | None = None
    bf16_supported: bool = False
    restart_count: int = 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, *, probe_cuda: bool = True) -> DistributedEnv:
        """Read the launcher's variables. `probe_cuda=False` skips importing torch (tests, builders).

        Raises:
            RuntimeError: a distributed variable is not an integer, or rank/world size disagree.
        """
        e = os.environ if environ is None else environ
        has_torch_vars = "RANK" in e or "LOCAL_RANK" in e or "WORLD_SIZE" in e
        if "TORCHELASTIC_RUN_ID" in e:
            launcher: Launcher = "torchrun"
        elif has_torch_vars and ("CROSS_RANK" in e or "LOCAL_SIZE" in e):
            launcher = "deepspeed"
        elif has_torch_vars:
            launcher = "env"
        elif "SLURM_PROCID" in e and "SLURM_STEP_ID" in e and _int(e, "SLURM_NTASKS", 1) > 1:
            launcher = "srun"
        else:
            launcher = "none"

        if launcher == "srun":
            rank = _int(e, "SLURM_PROCID", 0)
            local_rank = _int(e, "SLURM_LOCALID", 0)
            world_size = _int(e, "SLURM_NTASKS", 1)
            local_world_size = _int(e, "SLURM_NTASKS_PER_NODE", 0) or max(
                1, world_size // max(1, _int(e, "SLURM_NNODES", 1))
            )
        else:
            rank = _int(e, "RANK", 0)
            local_rank = _int(e, "LOCAL_RANK", 0)
            world_size = _int(e, "WORLD_SIZE", 1)
            local_world_size = _int(e, "LOCAL_WORLD_SIZE", _int(e, "LOCAL_SIZE", world_size))
        if world_size < 1:
            raise RuntimeError(f"world size {world_size} is not a positive number of ranks (launcher: {launcher})")
        if not 0 <= rank < world_size:
            raise RuntimeError(f"rank {rank} is outside world size {world_size} (launcher: {launcher})")
        port = e.get("MASTER_PORT")
        if port and not (port.isdigit() and 1 <= int(port) <= 65535):
            raise RuntimeError(f"environment variable MASTER_PORT={port!r} is not a TCP port (1-65535)")
        cuda_available, count, memory, bf16 = False, 0, None, False
        if probe_cuda:
            import torch

            cuda_available = torch.cuda.is_available()
            if cuda_available:
                count = torch.cuda.device_count()
                index = local_rank % max(1, count)
                memory = int(torch.cuda.get_device_properties(index).total_memory)
                bf16 = bool(torch.cuda.is_bf16_supported())
        return cls(
            launcher=launcher,
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            master_addr=e.get("MASTER_ADDR"),
            master_port=int(port) if port and port.isdigit() else None,
            cuda_available=cuda_available,
            cuda_device_count=count,
            device_memory_bytes=memory,
            bf16_supported=bf16,
            restart_count=_int(e, "TORCHELASTIC_RESTART_COUNT", 0),
        )

    @property
    def launched(self) -> bool:
        """True when a launcher started this process (even at world size 1)."""
        return self.launcher != "none"

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_type(self) -> str:
        return "cuda" if self.cuda_available else "cpu"

    @property
    def device(self) -> Any:
        """`torch.device` of this rank: `cuda:<local_rank>` where GPUs are visible, else `cpu`."""
        import torch

        if self.cuda_available:
            return torch.device("cuda", self.local_rank % max(1, self.cuda_device_count))
        return torch.device("cpu")

    def describe(self) -> str:
        where = f"rank {self.rank}/{self.world_size} (local {self.local_rank})"
        return f"launcher {self.launcher}, {where}, device {self.device_type}"


# ---------------------------------------------------------------------------------------------
# Rank-0 printing (nanochat's print0): rank 0 speaks, other ranks stay quiet unless it is an error.

_RANK = 0
_LOGGER = "scaletune"  # the parent of every module's `logging.getLogger(__name__)`


def _rank_level() -> int:
    return logging.INFO if _RANK == 0 else logging.WARNING


def set_rank(rank: int) -> None:
    """Record this process's rank for :func:`print0` and the level of scaletune's loggers (INFO on
    rank 0, WARNING elsewhere)."""
    global _RANK
    _RANK = rank
    logging.getLogger(_LOGGER).setLevel(_rank_level())


def current_rank() -> int:
    """This process's rank as :func:`set_rank` recorded it (0 before any)."""
    return _RANK


def configure_logging(rank: int | None = None) -> None:
    """Configure scaletune's logging, once per process, at an entry point (the command line, the
    trainer's entry, :func:`scaletune.hf.load_model_for_training`); modules only call
    `logging.getLogger(__name__)`, whose messages reach the `scaletune` logger configured here.

    One stderr handler writing `[scaletune] message` (stdout stays for machine output), not
    propagated to the root logger; level INFO on rank 0 and WARNING on the other ranks
    (`rank`, else the one :func:`set_rank` recorded). Calling it again only sets the rank.
    """
    logger = logging.getLogger(_LOGGER)
    if not any(h.get_name() == _LOGGER for h in logger.handlers):  # ours, not a test's or a user's
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[scaletune] %(message)s"))
        handler.set_name(_LOGGER)
        logger.addHandler(handler)
        logger.propagate = False
    set_rank(_RANK if rank is None else rank)


def print0(*args: Any, **kwargs: Any) -> None:
    """`print` on rank 0 only (to stderr by default, so stdout stays for machine output)."""
    if _RANK == 0:
        kwargs.setdefault("file", sys.stderr)
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


# mallopt(3) parameters from glibc's malloc.h.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def tune_host_allocator(mmap_threshold: int = 64 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Keep freed host blocks of up to `mmap_threshold` bytes in glibc's heap and trim the heap only
    past `trim_threshold` bytes free; returns False where that is not glibc (macOS, musl).

    A CPU training step frees and reallocates the same tensors of tens of MiB every step (each
    gradient of a 100k x 64 embedding is 25 MiB; so is a chunk of logits). glibc serves blocks above
    its mmap threshold (adaptive, 128 KiB to 32 MiB) as fresh mmaps and returns the top of the heap
    to the system past its trim threshold, so the next step faults the same pages in again, zeroed.
    Measured on the CPU benchmark (docs/benchmarks.md): about 1M minor page faults less per 23
    steps and 15-18% more tokens/s. The same settings as the environment variables
    MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ (which must be set before Python starts); the
    cost is freed memory held by the process instead of returned to the system.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name or sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


# ---------------------------------------------------------------------------------------------
# CPU threads: torch's intra-op pool sized to the cores this process may actually use.


@dataclass(frozen=True)
class CpuBudget:
    """The cores a CPU rank may use and the intra-op threads chosen from them.

    torch sizes its intra-op pool from the machine's cores, not from the process's affinity mask or
    its container's CPU quota, and every rank on a node does so: on a 64-core host whose container
    is allowed 2 cores, or with 4 ranks on 8 cores, the threads far outnumber the cores and spin
    against each other (a CPU run measured 1.1-1.6 tokens/s so, 10-13 with one thread per rank).

    Attributes:
        affinity: cores in this process's affinity mask (`os.sched_getaffinity`; `os.cpu_count`
            where the platform has no mask).
        quota: the cgroup CPU quota in cores (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us /
            cpu.cfs_period_us`), None when unlimited or unreadable.
        ranks: the processes sharing those cores on this node (`LOCAL_WORLD_SIZE`).
        omp: `OMP_NUM_THREADS` as set in the environment (by the user, or by torchrun, which sets 1
            for several ranks per node), None when unset or not a positive integer.
    """

    affinity: int
    quota: float | None
    ranks: int
    omp: int | None

    @property
    def cores(self) -> int:
        """Cores usable at once: the affinity mask, capped by the quota rounded down (at least 1),
        as Uber's automaxprocs sizes Go's GOMAXPROCS in a container."""
        if self.quota is None:
            return self.affinity
        return max(1, min(self.affinity, int(self.quota)))

    @property
    def threads(self) -> int:
        """Intra-op threads per rank: `OMP_NUM_THREADS` where set, else the cores split between the
        node's ranks (at least 1)."""
        return self.omp if self.omp is not None else max(1, self.cores // max(1, self.ranks))

    @property
    def oversubscribed(self) -> bool:
        """More threads on this node's ranks together than cores to run them."""
        return self.threads * self.ranks > self.cores

    def describe(self) -> str:
        """`2 per rank (2 cores: affinity 2, no CPU quota; 1 rank on this node)`, or the source."""
        quota = "no CPU quota" if self.quota is None else f"CPU quota {self.quota:g}"
        ranks = f"{self.ranks} rank{'s' if self.ranks != 1 else ''} on this node"
        source = "OMP_NUM_THREADS" if self.omp is not None else f"{self.cores} cores"
        return f"{self.threads} per rank ({source}: affinity {self.affinity}, {quota}; {ranks})"


def _cgroup_quota(root: Path) -> float | None:
    """The CPU quota in cores of the cgroup mounted at `root` (v2 `cpu.max`, else v1), or None."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "200000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())  # v1: -1 when unlimited
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def cpu_budget(
    ranks: int = 1, environ: Mapping[str, str] | None = None, *, cgroup_root: Path | str = "/sys/fs/cgroup"
) -> CpuBudget:
    """The CPU budget of a rank of `ranks` on this node (see :class:`CpuBudget`)."""
    e = os.environ if environ is None else environ
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity mask
        affinity = os.cpu_count() or 1
    omp = e.get("OMP_NUM_THREADS", "").strip()
    return CpuBudget(
        affinity=affinity,
        quota=_cgroup_quota(Path(cgroup_root)),
        ranks=max(1, ranks),
        omp=int(omp) if omp.isdigit() and int(omp) > 0 else None,
    )
