"""Checks of the machine: NCCL / torch variables, free disk, the rendezvous port."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from scaletune.doctor.checks import Check, ok
from scaletune.env import DistributedEnv

if TYPE_CHECKING:
    from scaletune.resolve import RunSpec

DEFAULT_PORT = 29500  # scaletune launch / torchrun's default rendezvous port


def check_nccl_env(env: DistributedEnv, environ: Mapping[str, str]) -> list[Check]:
    """NCCL / torch variables that commonly cause hangs or silent slowness."""
    out = []
    gpu_dist = env.cuda_available and env.world_size > 1
    try:
        names = {n for _, n in socket.if_nameindex()}
    except OSError:
        names = set()
    ifname = environ.get("NCCL_SOCKET_IFNAME")
    if ifname:
        wanted = [p for p in ifname.split(",") if p and not p.startswith("^")]
        exclude = ifname.startswith("^")
        missing = (
            [] if exclude or not names else [w for w in wanted if not any(n == w or n.startswith(w) for n in names)]
        )
        if missing:
            out.append(
                Check(
                    "NCCL_SOCKET_IFNAME",
                    "FAIL",
                    f"NCCL_SOCKET_IFNAME={ifname}: no interface {', '.join(missing)} here (have {', '.join(sorted(names))}); "
                    "NCCL hangs or fails at the first collective",
                    "set it to an interface that reaches the other nodes (`ip addr`), or unset it",
                    fatal=gpu_dist,
                )
            )
    gloo = environ.get("GLOO_SOCKET_IFNAME")
    if gloo:
        # gloo takes exact names only: no NCCL-style prefixes, '=' or '^' exclusion.
        missing = [w for w in gloo.split(",") if w.startswith(("^", "=")) or (names and w not in names)]
        if missing:
            out.append(
                Check(
                    "GLOO_SOCKET_IFNAME",
                    "FAIL",
                    f"GLOO_SOCKET_IFNAME={gloo}: no interface {', '.join(missing)} here (have {', '.join(sorted(names))}); "
                    "gloo takes exact interface names (no '^' exclusion, no prefixes), and every multi-rank "
                    "run starts a gloo group, so it fails at start-up",
                    "set it to the names of interfaces that reach the other nodes (`ip addr`), or unset it "
                    "(with NCCL_SOCKET_IFNAME set, scaletune derives it on each node)",
                    fatal=env.world_size > 1,
                )
            )
    for var in ("NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        if environ.get(var) == "0":
            out.append(
                Check(
                    var,
                    "WARN",
                    f"{var}=0: a failed rank leaves the others hanging until the timeout",
                    f"unset {var} (torch's default tears the job down on errors)",
                )
            )
    for var, why in (
        ("NCCL_P2P_DISABLE", "GPU-to-GPU traffic goes through host memory"),
        ("NCCL_IB_DISABLE", "multi-node traffic uses TCP instead of InfiniBand/RoCE"),
    ):
        if environ.get(var) == "1":
            out.append(
                Check(
                    var,
                    "WARN",
                    f"{var}=1: {why} (slower; right only where the hardware needs it)",
                    f"unset {var} unless it works around a known hang",
                )
            )
    if environ.get("CUDA_LAUNCH_BLOCKING") == "1":
        out.append(
            Check(
                "CUDA_LAUNCH_BLOCKING",
                "WARN",
                "CUDA_LAUNCH_BLOCKING=1 serialises every kernel (debugging only)",
                "unset CUDA_LAUNCH_BLOCKING",
            )
        )
    if environ.get("NCCL_BLOCKING_WAIT") or environ.get("TORCH_NCCL_BLOCKING_WAIT") == "1":
        out.append(
            Check(
                "TORCH_NCCL_BLOCKING_WAIT",
                "WARN",
                "blocking wait makes every collective poll the CPU",
                "unset NCCL_BLOCKING_WAIT / TORCH_NCCL_BLOCKING_WAIT",
            )
        )
    if not out:
        out.append(ok("NCCL variables", "no variable known to cause hangs is set"))
    return out


def _parameters(spec: RunSpec) -> tuple[int, int] | None:
    """(total, trainable) parameters of the run's model as the planner counts them (its config
    built on the meta device, LoRA adapters included; a full fine-tune of a local safetensors
    folder from its headers), or None where it cannot be built here."""
    from scaletune.models.checks import stored_parameters
    from scaletune.plan.shapes import model_shape

    cfg = spec.config
    patterns = any(s.trainable is not None or s.frozen is not None for s in spec.stages)
    if cfg.model.lora is None and cfg.model.quantization is None and not patterns:
        # A full fine-tune trains every stored parameter: the headers count them without building
        # the model (about 2 s of CPU, a third of `train --check`).
        stored = stored_parameters(cfg.model.name_or_path)
        if stored is not None:
            return stored, stored
    try:
        shape = model_shape(spec)
    except Exception:  # no config.json reachable (an unknown hub id offline, a broken folder)
        return None
    return shape.total, shape.trainable


def _existing_parent(path: Path) -> Path:
    p = path.resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_disk(spec: RunSpec | None) -> Check:
    """Free disk at output_dir against the checkpoints the run keeps (real `shutil.disk_usage`).

    FAIL (fatal) below the final model plus one checkpoint; WARN below the peak: `keep_last`
    checkpoints plus the larger of the one being written and the final model. Sizes: a checkpoint is
    12 bytes per trainable parameter (fp32 weights and Adam's two moments), the final model 2 or 4
    per parameter (4 per adapter parameter under LoRA)."""
    name = "free disk"
    if spec is None:
        return ok(name, "no config")
    cfg = spec.config
    if cfg.model.factory is not None:
        return ok(name, "not checked: model.factory builds a module of unknown size")
    counts = _parameters(spec)
    if counts is None:
        return Check(
            name,
            "WARN",
            f"cannot size the model of {cfg.model.name_or_path} from its config on the meta device; disk not checked",
        )
    n, trainable = counts
    if cfg.model.lora is not None:
        final = 4 * trainable  # the adapters, float32
    else:
        final = 4 * n if cfg.model.dtype == "float32" else 2 * n
    ckpt = 4 * trainable * 3  # fp32 weights + Adam's two moments
    keep = cfg.training.keep_last if cfg.training.save_every else 0
    need_min = final + (ckpt if keep else 0)
    # The peak: a new checkpoint is written beside the `keep` intact ones and the oldest pruned only
    # once it is complete (checkpoint/save.py), and the final model is written beside the kept ones.
    need = keep * ckpt + max(ckpt if keep else 0, final)
    where = _existing_parent(Path(cfg.output_dir))
    free = shutil.disk_usage(where).free
    gb = 1e9
    msg = (
        f"{free / gb:,.1f} GB free at {where}; the run needs ~{need / gb:,.1f} GB at its peak "
        f"({keep} checkpoint(s) of ~{ckpt / gb:,.1f} GB kept, "
        + ("one more while the next is written, " if keep else "")
        + f"a final model of ~{final / gb:,.1f} GB)"
    )
    if free < need_min:
        return Check(name, "FAIL", msg, "free disk space or point output_dir at a larger disk", fatal=True)
    if free < need:
        return Check(name, "WARN", msg, "lower training.keep_last or free disk space")
    return ok(name, msg)


def port_free(port: int, host: str = "0.0.0.0") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def check_port(env: DistributedEnv, environ: Mapping[str, str]) -> Check:
    """The rendezvous port must be free where this process is to open it.

    Under torchrun / the deepspeed launcher the agent holds the port (taken is right). A process
    that will open the store itself (rank 0 under launcher `env` without torchrun's agent store)
    fails on a taken port: fatal. Without a launcher the port that `scaletune launch` would use
    (MASTER_PORT or 29500) is checked: a warning.
    """
    name = "rendezvous port"
    raw = environ.get("MASTER_PORT")
    port = int(raw) if raw and raw.isdigit() and 1 <= int(raw) <= 65535 else DEFAULT_PORT
    if env.launcher in ("torchrun", "deepspeed", "srun") or environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return ok(name, f"port {port} held by the launcher")
    if env.launcher == "env":
        if env.rank != 0 or env.world_size == 1:
            return ok(name, f"rank {env.rank} connects to {environ.get('MASTER_ADDR')}:{port}")
        if not port_free(port):
            return Check(
                name,
                "FAIL",
                f"MASTER_PORT {port} is already in use: rank 0 cannot open the rendezvous there",
                "choose a free MASTER_PORT or stop the process holding it (`ss -ltnp`)",
                fatal=True,
            )
        return ok(name, f"port {port} free for rank 0's rendezvous")
    if not port_free(port):
        return Check(
            name,
            "WARN",
            f"port {port} (the rendezvous port `scaletune launch` would use) is in use",
            "pass --master-port with a free port (single-node `scaletune train` picks one itself)",
        )
    return ok(name, f"port {port} free")
