"""The process group of a run: which backend carries which device's collectives, how it is started,
and the group ranks wait on while rank 0 works alone.

Two groups, two timeouts:

* the default group carries the training collectives (NCCL on GPUs, gloo on CPUs) with
  `distributed.timeout_minutes` (the NCCL watchdog's): a collective that hangs that long is a bug
  or a dead peer, and the watchdog ends the job;
* a gloo group with `distributed.barrier_timeout_minutes` carries only the barriers where the other
  ranks wait for rank 0 to finish something alone: tokenising the data into the cache, converting a
  ZeRO checkpoint to DeepSpeed's universal format, writing checkpoints and the exported model. Those
  can take hours on large jobs, longer than any sensible collective timeout. Waiting there on the
  default group would put every other rank inside an NCCL collective whose watchdog aborts the job
  at `timeout_minutes`. A barrier moves no data, so a gloo barrier costs milliseconds; and a rank
  that dies is still noticed at once, by the launcher (torchrun, srun) ending the job, not by this
  timeout, so a long one delays nothing but a rank 0 that hangs without dying.
  `torch.distributed.monitored_barrier` names the ranks that did not arrive when it does time out.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
from collections.abc import Iterable, MutableMapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from scaletune.env import DistributedEnv

#: The backend string when parameters live on the CPU under NCCL (FSDP2 CPU offload): collectives
#: on CPU tensors go over gloo, those on CUDA tensors over NCCL (torch's per-device backends).
MIXED_BACKEND = "cpu:gloo,cuda:nccl"

log = logging.getLogger(__name__)


def select_backend(requested: str, *, cuda_available: bool, cpu_collectives: bool = False) -> str:
    """The torch.distributed backend string for `distributed.backend`.

    `auto` is NCCL on GPUs and gloo on CPUs. Where CUDA is used and the engine also runs
    collectives on CPU tensors (`cpu_collectives`: FSDP2 with parameters offloaded to the CPU, whose
    state-dict broadcasts and gradient-norm reductions see CPU DTensors, pytorch#148532), NCCL alone
    cannot carry them: the result is the mixed backend `cpu:gloo,cuda:nccl`.

    Raises:
        RuntimeError: `nccl` asked without a CUDA GPU.
    """
    if requested == "nccl" and not cuda_available:
        raise RuntimeError("distributed.backend nccl needs CUDA GPUs; use gloo (or auto) on CPU")
    if requested == "gloo" or not cuda_available:
        return "gloo"
    return MIXED_BACKEND if cpu_collectives else "nccl"


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nccl_interface_matches(spec: str, names: Iterable[str]) -> list[str]:
    """The interfaces among `names` (in their order) that `NCCL_SOCKET_IFNAME=spec` lets NCCL use.

    NCCL's syntax: a comma-separated list of prefixes (`eth` matches eth0, eth1), `=` before the
    list for exact names (`=eth0`), `^` before it to exclude instead (`^docker,lo`, `^=docker0`).
    """
    exclude = spec.startswith("^")
    spec = spec.removeprefix("^")
    exact = spec.startswith("=")
    items = [item for item in spec.removeprefix("=").split(",") if item]
    return [n for n in names if any(n == i if exact else n.startswith(i) for i in items) != exclude]


def gloo_interface(nccl_spec: str, interfaces: Sequence[tuple[str, bool, bool]]) -> str | None:
    """The one interface gloo should use where NCCL is told `nccl_spec`: gloo takes only concrete
    names (no prefixes, no `^` exclusion), so this picks the first of NCCL's matches that is up and
    has an address, loopback only where nothing else matches; None where none does.

    `interfaces`: (name, up and addressed, loopback) in the host's order.
    """
    usable = {name: loopback for name, ok, loopback in interfaces if ok}
    matches = nccl_interface_matches(nccl_spec, usable)
    return next((n for n in matches if not usable[n]), matches[0] if matches else None)


def host_interfaces() -> list[tuple[str, bool, bool]]:
    """This host's interfaces as :func:`gloo_interface` reads them (psutil)."""
    import socket

    import psutil

    stats = psutil.net_if_stats()
    out = []
    for name, addrs in psutil.net_if_addrs().items():
        ips = [a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
        up = name in stats and stats[name].isup and bool(ips)
        loopback = bool(ips) and all(ip.startswith("127.") or ip.split("%")[0] == "::1" for ip in ips)
        out.append((name, up, loopback))
    return out


def derive_gloo_ifname(
    environ: MutableMapping[str, str], interfaces: Sequence[tuple[str, bool, bool]] | None = None
) -> None:
    """Set `GLOO_SOCKET_IFNAME` on this node from `NCCL_SOCKET_IFNAME` where only NCCL's is set.

    Every multi-rank run builds gloo groups (the wait group, CPU collectives), and gloo fails on
    NCCL's prefixes and `^` exclusions (`socket-ifname=^docker,lo`), so the launch leaves gloo's
    variable to be resolved here, on the node, against its own interfaces (`interfaces`: as
    :func:`host_interfaces` returns; read from the host when None). A `GLOO_SOCKET_IFNAME` already
    set is kept; where nothing matches, gloo is left to its default and a warning says so.
    """
    spec = environ.get("NCCL_SOCKET_IFNAME")
    if not spec or environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = gloo_interface(spec, host_interfaces() if interfaces is None else interfaces)
    if name is None:
        log.warning(f"NCCL_SOCKET_IFNAME={spec} matches no interface that is up here; GLOO_SOCKET_IFNAME left unset")
        return
    environ["GLOO_SOCKET_IFNAME"] = name
    log.info(f"GLOO_SOCKET_IFNAME={name} (derived from NCCL_SOCKET_IFNAME={spec}: gloo needs one concrete name)")


_GROUPS_STARTED = itertools.count()  # default groups this process started on torchrun's store


def init_process_group(
    env: DistributedEnv,
    backend: str = "auto",
    timeout_minutes: float = 30,
    *,
    even_alone: bool = False,
    cpu_collectives: bool = False,
) -> bool:
    """Start the default process group for a launched multi-rank job (backend: :func:`select_backend`).

    `even_alone`: also start a group of one for a plain single process (FSDP and DeepSpeed need a
    group at world size 1), on a free loopback port. `cpu_collectives`: see :func:`select_backend`.
    Under a launcher, gloo's interface is first derived from NCCL's (:func:`derive_gloo_ifname`).

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
    backend = select_backend(backend, cuda_available=env.cuda_available, cpu_collectives=cpu_collectives)
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(f"{var} is not set: start multi-rank runs with torchrun, deepspeed or scaletune launch")
    if env.is_distributed:
        derive_gloo_ifname(os.environ)
    if env.cuda_available:
        torch.cuda.set_device(env.device)
    kwargs: dict[str, Any] = {}
    if "nccl" in backend:
        kwargs["device_id"] = env.device  # binds the communicator to this rank's GPU up front
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps one store across restarts: without a per-attempt prefix, restarted ranks
        # read the addresses the killed ranks published and gloo fails with "connectFullMesh ...
        # Connection refused" (pytorch#167288).
        # The same holds for a group started again in the same process (a second run of the
        # trainer in one torchrun's ranks): each gets a prefix of its own, counted alike on every rank.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        kwargs["store"] = dist.PrefixStore(f"scaletune/attempt-{attempt}/group-{next(_GROUPS_STARTED)}", store)
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs)
    return True


class WaitGroup:
    """The gloo group ranks wait on while rank 0 works alone (see the module docstring).

    Created collectively (every rank calls :meth:`create`) right after the default group.
    """

    def __init__(self, group: Any, timeout_minutes: float) -> None:
        self.group = group
        self.timeout = datetime.timedelta(minutes=timeout_minutes)

    @classmethod
    def create(cls, timeout_minutes: float) -> WaitGroup | None:
        """A gloo group over every rank with `timeout_minutes`; None without a process group."""
        if not dist.is_initialized():
            return None
        timeout = datetime.timedelta(minutes=timeout_minutes)
        return cls(dist.new_group(backend="gloo", timeout=timeout), timeout_minutes)

    def barrier(self) -> None:
        """Wait until every rank arrives; raises RuntimeError naming the missing ranks after the timeout."""
        dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)


@torch.no_grad()
def broadcast_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor], group: Any = None) -> None:
    """Give every rank of `group` (default: the world) the buffers (rotary `inv_freq`, ...) of its
    first rank, which holds them by name in `buffers` (the others pass an empty dict). The sharded
    engines fill parameters from a state dict and the buffers through this, since a state dict
    skips non-persistent buffers."""
    leader = dist.get_rank(group) == 0
    for name, buf in model.named_buffers():
        src = buffers[name].to(buf.device) if leader else buf
        dist.broadcast(src, group=group, group_src=0)
        if leader:
            buf.copy_(src)
