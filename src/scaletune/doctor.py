"""Environment report, preflight checks and the communication test (`scaletune doctor`).

:func:`checks` turns every known cause of a failed or hung distributed run into one line with
its fix; :func:`preflight` runs them at the start of `train` (before any model loads: it reads
the model's config.json at most, imports no model code, and imports DeepSpeed only when the run
uses it) and raises one :class:`~scaletune.errors.UserError` naming every fatal problem.

Stale distributed variables. `DistributedEnv` calls a process with `RANK`/`WORLD_SIZE` but no
torchrun (`TORCHELASTIC_RUN_ID`) or deepspeed-launcher marker launcher `env` (accelerate, mpirun
wrappers and hand-set variables look like that). Such a process is a real rank only if it can
reach the rendezvous, so: `WORLD_SIZE > 1` without `MASTER_ADDR` or `MASTER_PORT` is fatal (a
stale `WORLD_SIZE` exported by another job, or a half-set environment: `init_process_group` would
fail or wait for peers that never come); inside a SLURM step whose task count disagrees with
`WORLD_SIZE` it is fatal too (variables left over from another job); `WORLD_SIZE` of 1 or
`MASTER_*` alone without a launcher is a warning (harmless here, surprising later).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping

from scaletune.env import DistributedEnv
from scaletune.errors import UserError

if TYPE_CHECKING:
    from scaletune.config import Config

Status = Literal["OK", "WARN", "FAIL"]
DEFAULT_PORT = 29500  # scaletune launch / torchrun's default rendezvous port


@dataclass(frozen=True)
class Check:
    """One check's outcome. `fatal`: preflight stops the run (only with status FAIL)."""

    name: str
    status: Status
    message: str
    fix: str = ""
    fatal: bool = False

    def to_json(self) -> dict:
        return asdict(self)


def _ok(name: str, message: str) -> Check:
    return Check(name, "OK", message)


# ---------------------------------------------------------------------------------------------
# Report


_PACKAGES = ("torch", "transformers", "peft", "datasets", "accelerate", "deepspeed", "bitsandbytes", "liger-kernel", "safetensors")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def report(env: DistributedEnv, environ: Mapping[str, str] | None = None) -> dict:
    """Versions, GPUs, launcher and distributed variables of this process."""
    import torch

    e = os.environ if environ is None else environ
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {p: _version(p) for p in _PACKAGES},
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
            if k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
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


# ---------------------------------------------------------------------------------------------
# Checks


def check_launcher_vars(env: DistributedEnv, environ: Mapping[str, str]) -> Check:
    name = "distributed variables"
    if env.launcher in ("torchrun", "deepspeed", "srun"):
        return _ok(name, f"started by {env.launcher}: rank {env.rank} of {env.world_size}")
    fix = "unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT, or start the job with torchrun / scaletune launch"
    if env.launcher == "env":
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(v)]
        slurm_tasks = environ.get("SLURM_NTASKS")
        if env.world_size > 1 and missing:
            return Check(
                name, "FAIL",
                f"WORLD_SIZE={env.world_size} (RANK={environ.get('RANK', 'unset')}) is set but no launcher started "
                f"this process and {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing: a stale "
                "variable from another job or shell, and the run would wait for peers that never come",
                fix, fatal=True,
            )  # fmt: skip
        if env.world_size > 1 and slurm_tasks and "SLURM_STEP_ID" in environ and slurm_tasks.isdigit():
            if int(slurm_tasks) != env.world_size and int(slurm_tasks) != env.world_size // max(1, env.local_world_size):
                return Check(
                    name, "FAIL",
                    f"WORLD_SIZE={env.world_size} disagrees with this SLURM step's {slurm_tasks} task(s): "
                    "variables left over from another job",
                    fix + " (under srun let scaletune read SLURM_PROCID/SLURM_NTASKS)", fatal=True,
                )  # fmt: skip
        if env.world_size > 1:
            return _ok(name, f"RANK/WORLD_SIZE set by an external launcher: rank {env.rank} of {env.world_size}, "
                             f"rendezvous {environ.get('MASTER_ADDR')}:{environ.get('MASTER_PORT')}")  # fmt: skip
        return Check(
            name, "WARN",
            f"distributed variables ({', '.join(v for v in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE') if v in environ)}) are set "
            "without a launcher at world size 1: probably left over; device_map is ignored while they are set",
            fix,
        )  # fmt: skip
    stray = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v in environ]
    if stray:
        return Check(name, "WARN", f"{' and '.join(stray)} set without a launcher (harmless for one process)", fix)
    return _ok(name, "no launcher: one process")


def check_processes_vs_gpus(env: DistributedEnv, cfg: Config | None, environ: Mapping[str, str]) -> Check:
    name = "processes per GPU"
    visible = environ.get("CUDA_VISIBLE_DEVICES", "unset")
    if env.cuda_available:
        if env.launched and env.local_world_size > env.cuda_device_count:
            return Check(
                name, "FAIL",
                f"{env.local_world_size} processes on this node but {env.cuda_device_count} visible GPU(s) "
                f"(CUDA_VISIBLE_DEVICES={visible}): ranks would share a GPU (NCCL 'Duplicate GPU detected')",
                f"start at most {env.cuda_device_count} processes per node (--nproc_per_node {env.cuda_device_count})", fatal=True,
            )  # fmt: skip
        n = cfg.distributed.num_processes if cfg is not None else "auto"
        if not env.launched and isinstance(n, int) and n > env.cuda_device_count:
            return Check(
                name, "FAIL",
                f"distributed.num_processes is {n} but {env.cuda_device_count} GPU(s) are visible (CUDA_VISIBLE_DEVICES={visible})",
                f"set distributed.num_processes to {env.cuda_device_count} or auto", fatal=True,
            )  # fmt: skip
        return _ok(name, f"{env.local_world_size if env.launched else 1} process(es), {env.cuda_device_count} GPU(s) visible")
    return _ok(name, f"no GPU: {env.local_world_size} CPU process(es) on this node (gloo)")


def check_device_map(env: DistributedEnv, cfg: Config | None) -> Check:
    name = "device_map"
    if cfg is None or cfg.model.device_map is None:
        return _ok(name, "no device_map")
    if env.launched:
        return Check(
            name, "WARN",
            f"model.device_map={cfg.model.device_map} under a launcher ({env.launcher}): it is set aside, each rank loads "
            "its replica or shard on its own device",
            "drop model.device_map when training with several processes",
        )  # fmt: skip
    return _ok(name, f"device_map {cfg.model.device_map} in one process")


def _strategy_of(cfg: Config, env: DistributedEnv) -> tuple[str, int]:
    from scaletune.strategies import choose_strategy

    return choose_strategy(cfg, env), cfg.distributed.zero_stage


def check_quantization(env: DistributedEnv, cfg: Config | None) -> list[Check]:
    if cfg is None or cfg.model.quantization is None:
        return [_ok("quantization", "no quantization")]
    q = cfg.model.quantization
    out = []
    if not env.cuda_available:
        out.append(Check(
            "quantization", "FAIL",
            f"model.quantization ({q.bits}-bit bitsandbytes) needs a CUDA GPU and none is visible",
            "drop model.quantization (LoRA on unquantized weights) or run on a GPU machine", fatal=True,
        ))  # fmt: skip
    elif _version("bitsandbytes") is None:
        out.append(Check("quantization", "FAIL", "model.quantization needs bitsandbytes, which is not installed",
                         "pip install 'scaletune[gpu]'", fatal=True))  # fmt: skip
    else:
        out.append(_ok("quantization", f"{q.bits}-bit on GPU with bitsandbytes {_version('bitsandbytes')}"))
    strategy, stage = _strategy_of(cfg, env)
    shards = strategy == "fsdp" or (strategy == "deepspeed" and stage == 3)
    where = "fsdp" if strategy == "fsdp" else "deepspeed zero_stage 3"
    if shards and q.bits == 8:
        out.append(Check("quantization strategy", "FAIL", f"8-bit weights cannot be sharded by {where}",
                         f"use bits: 4 with storage_dtype: {cfg.model.dtype}, or strategy ddp", fatal=True))  # fmt: skip
    elif shards and q.storage_dtype != cfg.model.dtype:
        out.append(Check(
            "quantization storage dtype", "FAIL",
            f"4-bit weights under {where} are stored as {q.storage_dtype} but the other parameters are {cfg.model.dtype}: "
            "they cannot be flattened into one shard",
            f"set model.quantization.storage_dtype: {cfg.model.dtype}", fatal=True,
        ))  # fmt: skip
    else:
        out.append(_ok("quantization strategy", f"{q.bits}-bit weights with strategy {strategy}"))
    return out


def check_liger(env: DistributedEnv, cfg: Config | None) -> Check:
    """`model.liger` needs a CUDA GPU (Liger's kernels are Triton GPU kernels) and liger-kernel;
    checked without importing it. Its clash with ZeRO-3 is a config error (config.cross_field_problems)."""
    name = "liger"
    if cfg is None or not cfg.model.liger:
        return _ok(name, "model.liger off")
    if not env.cuda_available:
        return Check(name, "FAIL", "model.liger (Liger's Triton kernels) needs a CUDA GPU and none is visible",
                     "set model.liger: false (the built-in chunked loss runs on any device) or run on a GPU machine",
                     fatal=True)  # fmt: skip
    if _version("liger-kernel") is None:
        return Check(name, "FAIL", "model.liger needs liger-kernel, which is not installed",
                     "pip install 'scaletune[liger]'", fatal=True)  # fmt: skip
    return _ok(name, f"Liger kernels on GPU with liger-kernel {_version('liger-kernel')}")


def check_checkpointing(env: DistributedEnv, cfg: Config | None) -> Check:
    """DDP + LoRA + reentrant checkpointing fails with 'Expected to mark a variable ready only once'."""
    import inspect

    from scaletune import models

    name = "checkpointing under ddp"
    if cfg is None or cfg.model.lora is None or not cfg.model.gradient_checkpointing:
        return _ok(name, "not LoRA with gradient checkpointing")
    strategy, _ = _strategy_of(cfg, env)
    if strategy != "ddp":
        return _ok(name, f"strategy {strategy}")
    default = inspect.signature(models.enable_gradient_checkpointing).parameters["use_reentrant"].default
    if default is not False:
        return Check(
            name, "FAIL",
            "LoRA with gradient checkpointing under DDP with reentrant checkpointing: backward fails with "
            "'Expected to mark a variable ready only once'",
            "use non-reentrant checkpointing (use_reentrant=False)", fatal=True,
        )  # fmt: skip
    return _ok(name, "LoRA + checkpointing under ddp uses non-reentrant checkpointing")


def check_batch(env: DistributedEnv, cfg: Config | None, world_size: int | None = None) -> Check:
    from scaletune.config import batch_arithmetic, resolve_stages

    name = "batch arithmetic"
    if cfg is None:
        return _ok(name, "no config")
    w = world_size or env.world_size
    try:
        described = ""
        for stage in resolve_stages(cfg):
            described = described or batch_arithmetic(stage.training, w, stage.data.max_seq_length).describe()
    except UserError as exc:
        return Check(name, "FAIL", exc.problems[0], "change training.global_batch_size or micro_batch_size", fatal=True)
    return _ok(name, described)


def check_deepspeed_ops(cfg: Config | None, builders: list[str] | None = None) -> Check:
    """DeepSpeed's ops this run needs can be built here (`OpBuilder.is_compatible()`)."""
    name = "deepspeed ops"
    if builders is None:
        if cfg is None or cfg.distributed.strategy != "deepspeed":
            return _ok(name, "DeepSpeed not used")
        builders = ["CPUAdamBuilder"] if cfg.distributed.offload_optimizer else []
    if _version("deepspeed") is None:
        return Check(name, "FAIL", "distributed.strategy deepspeed but DeepSpeed is not installed",
                     "pip install 'scaletune[deepspeed]', or choose ddp or fsdp", fatal=True)  # fmt: skip
    if not builders:
        return _ok(name, f"deepspeed {_version('deepspeed')}; no custom op needed")
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        bad = []
        for b in builders:
            builder = acc.create_op_builder(b)
            if builder is None or not builder.is_compatible(verbose=False):
                bad.append(b)
    except Exception as exc:  # noqa: BLE001 - any failure here means the op cannot be built
        return Check(name, "FAIL", f"DeepSpeed ops cannot be checked: {type(exc).__name__}: {exc}",
                     "reinstall deepspeed matching this torch/CUDA (`ds_report`)", fatal=True)  # fmt: skip
    if bad:
        return Check(
            name, "FAIL", f"DeepSpeed op(s) {', '.join(bad)} cannot be built on this machine ({acc.device_name()})",
            "run `ds_report` and install the missing toolchain (a C++ compiler, libaio-dev, the CUDA toolkit), or drop the offload",
            fatal=True,
        )  # fmt: skip
    return _ok(name, f"{', '.join(builders)} compatible ({acc.device_name()})")


def check_nccl_env(env: DistributedEnv, environ: Mapping[str, str]) -> list[Check]:
    """NCCL / torch variables that commonly cause hangs or silent slowness."""
    out = []
    gpu_dist = env.cuda_available and env.world_size > 1
    ifname = environ.get("NCCL_SOCKET_IFNAME")
    if ifname:
        try:
            names = {n for _, n in socket.if_nameindex()}
        except OSError:
            names = set()
        wanted = [p for p in ifname.split(",") if p and not p.startswith("^")]
        exclude = ifname.startswith("^")
        missing = [] if exclude or not names else [w for w in wanted if not any(n == w or n.startswith(w) for n in names)]
        if missing:
            out.append(Check(
                "NCCL_SOCKET_IFNAME", "FAIL",
                f"NCCL_SOCKET_IFNAME={ifname}: no interface {', '.join(missing)} here (have {', '.join(sorted(names))}); "
                "NCCL hangs or fails at the first collective",
                "set it to an interface that reaches the other nodes (`ip addr`), or unset it", fatal=gpu_dist,
            ))  # fmt: skip
    for var in ("NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        if environ.get(var) == "0":
            out.append(Check(var, "WARN", f"{var}=0: a failed rank leaves the others hanging until the timeout",
                             f"unset {var} (torch's default tears the job down on errors)"))  # fmt: skip
    for var, why in (("NCCL_P2P_DISABLE", "GPU-to-GPU traffic goes through host memory"),
                     ("NCCL_IB_DISABLE", "multi-node traffic uses TCP instead of InfiniBand/RoCE")):  # fmt: skip
        if environ.get(var) == "1":
            out.append(Check(var, "WARN", f"{var}=1: {why} (slower; right only where the hardware needs it)",
                             f"unset {var} unless it works around a known hang"))  # fmt: skip
    if environ.get("CUDA_LAUNCH_BLOCKING") == "1":
        out.append(Check("CUDA_LAUNCH_BLOCKING", "WARN", "CUDA_LAUNCH_BLOCKING=1 serialises every kernel (debugging only)",
                         "unset CUDA_LAUNCH_BLOCKING"))  # fmt: skip
    if environ.get("NCCL_BLOCKING_WAIT") or environ.get("TORCH_NCCL_BLOCKING_WAIT") == "1":
        out.append(Check("TORCH_NCCL_BLOCKING_WAIT", "WARN", "blocking wait makes every collective poll the CPU",
                         "unset NCCL_BLOCKING_WAIT / TORCH_NCCL_BLOCKING_WAIT"))  # fmt: skip
    if not out:
        out.append(_ok("NCCL variables", "no variable known to cause hangs is set"))
    return out


def _config_json(cfg: Config) -> dict | None:
    from scaletune.models import PRESETS

    name = cfg.model.name_or_path
    p = Path(name).expanduser()
    if (p / "config.json").is_file():
        try:
            return json.loads((p / "config.json").read_text())
        except (OSError, ValueError):
            return None
    if name in PRESETS:
        return dict(PRESETS[name].kwargs)
    return None


def estimate_parameters(c: dict) -> int | None:
    """Parameters of a decoder-only transformer from its config.json (no model code)."""
    c = c.get("text_config", c)
    try:
        h, L, V = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
    heads = int(c.get("num_attention_heads", 1))
    hd = int(c.get("head_dim") or h // heads)
    kv = int(c.get("num_key_value_heads") or heads)
    i = int(c.get("intermediate_size") or 4 * h)
    attn = h * hd * heads * 2 + 2 * h * hd * kv
    mlp = 3 * h * i
    emb = V * h * (1 if c.get("tie_word_embeddings") else 2)
    return emb + L * (attn + mlp + 2 * h) + h


def _existing_parent(path: Path) -> Path:
    p = path.resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_disk(cfg: Config | None) -> Check:
    """Free disk at output_dir against the checkpoints the run keeps (real `shutil.disk_usage`)."""
    name = "free disk"
    if cfg is None:
        return _ok(name, "no config")
    c = _config_json(cfg)
    n = estimate_parameters(c) if c else None
    if n is None:
        return Check(name, "WARN", f"cannot size the model of {cfg.model.name_or_path} from a config.json; disk not checked")
    if cfg.model.lora is not None:
        trainable = max(1, n // 200)  # adapters: well under 1% of the model at usual ranks
        final = 4 * trainable
    else:
        trainable = n
        final = 4 * n if cfg.model.dtype == "float32" else 2 * n
    ckpt = 4 * trainable * 3  # fp32 weights + Adam's two moments
    keep = cfg.training.keep_last if cfg.training.save_every else 0
    need_min = final + (ckpt if keep else 0)
    need = final + keep * ckpt
    where = _existing_parent(Path(cfg.output_dir))
    free = shutil.disk_usage(where).free
    gb = 1e9
    msg = (f"{free / gb:,.1f} GB free at {where}; the run writes ~{need / gb:,.1f} GB "
           f"({keep} checkpoint(s) of ~{ckpt / gb:,.1f} GB and a final model of ~{final / gb:,.1f} GB)")  # fmt: skip
    if free < need_min:
        return Check(name, "FAIL", msg, "free disk space or point output_dir at a larger disk", fatal=True)
    if free < need:
        return Check(name, "WARN", msg, "lower training.keep_last or free disk space")
    return _ok(name, msg)


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
    port = int(raw) if raw and raw.isdigit() else DEFAULT_PORT
    if env.launcher in ("torchrun", "deepspeed", "srun") or environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return _ok(name, f"port {port} held by the launcher")
    if env.launcher == "env":
        if env.rank != 0 or env.world_size == 1:
            return _ok(name, f"rank {env.rank} connects to {environ.get('MASTER_ADDR')}:{port}")
        if not port_free(port):
            return Check(name, "FAIL", f"MASTER_PORT {port} is already in use: rank 0 cannot open the rendezvous there",
                         "choose a free MASTER_PORT or stop the process holding it (`ss -ltnp`)", fatal=True)  # fmt: skip
        return _ok(name, f"port {port} free for rank 0's rendezvous")
    if not port_free(port):
        return Check(name, "WARN", f"port {port} (the rendezvous port `scaletune launch` would use) is in use",
                     "pass --master-port with a free port (single-node `scaletune train` picks one itself)")  # fmt: skip
    return _ok(name, f"port {port} free")


def checks(cfg: Config | None, env: DistributedEnv, environ: Mapping[str, str] | None = None, *, world_size: int | None = None) -> list[Check]:
    """Every check, in a fixed order (see the module docstring and docs/plan.md)."""
    e = os.environ if environ is None else environ
    out = [
        check_launcher_vars(env, e),
        check_processes_vs_gpus(env, cfg, e),
        check_device_map(env, cfg),
        *check_quantization(env, cfg),
        check_liger(env, cfg),
        check_checkpointing(env, cfg),
        check_batch(env, cfg, world_size),
        check_deepspeed_ops(cfg),
        *check_nccl_env(env, e),
        check_disk(cfg),
        check_port(env, e),
    ]
    return out


def preflight(cfg: Config, env: DistributedEnv, environ: Mapping[str, str] | None = None) -> list[Check]:
    """Run :func:`checks`; raise one UserError naming every fatal problem with its fix.

    Raises:
        UserError: (exit 2) one line per fatal check.
    """
    results = checks(cfg, env, environ)
    fatal = [c for c in results if c.fatal and c.status == "FAIL"]
    if fatal:
        raise UserError([f"{c.name}: {c.message}. Fix: {c.fix}" for c in fatal], title="preflight failed")
    return results


# ---------------------------------------------------------------------------------------------
# Communication test


def comm_test(sizes: tuple[int, ...] = (1 << 10, 1 << 16, 1 << 20, 1 << 24), iters: int = 5) -> list[dict]:
    """all_reduce, all_gather and reduce_scatter over the launched ranks, each checked for the
    right values, with bandwidth per message size (nccl-tests' algbw and busbw conventions).

    Run under a launcher (`torchrun --nproc_per_node N -m scaletune doctor --comm-test`); gloo on
    CPU (which supports `reduce_scatter_tensor` in torch 2.13), NCCL on GPUs.

    Returns:
        One record per (op, bytes): {"op", "bytes", "ok", "time_s", "algbw_GBps", "busbw_GBps"}.
    """
    import torch
    import torch.distributed as dist

    env = DistributedEnv.from_environ()
    own = not dist.is_initialized()
    if own:
        if env.world_size < 2:
            raise UserError("--comm-test needs several ranks: torchrun --nproc_per_node 2 -m scaletune doctor --comm-test",
                            title="no ranks to test")  # fmt: skip
        if env.cuda_available:
            torch.cuda.set_device(env.device)
        dist.init_process_group("nccl" if env.cuda_available else "gloo")
    try:
        r, w = dist.get_rank(), dist.get_world_size()
        dev = env.device
        out = []
        for size in sizes:
            n = max(w, size // 4 // w * w)  # float32 elements, divisible by the world size
            chunk = n // w
            cases = {
                "all_reduce": (2 * (w - 1) / w),
                "all_gather": ((w - 1) / w),
                "reduce_scatter": ((w - 1) / w),
            }
            for op, factor in cases.items():
                def run() -> bool:
                    if op == "all_reduce":
                        t = torch.full((n,), float(r + 1), device=dev)
                        dist.all_reduce(t)
                        return bool(torch.all(t == w * (w + 1) / 2))
                    if op == "all_gather":
                        t = torch.empty(n, device=dev)
                        dist.all_gather_into_tensor(t, torch.full((chunk,), float(r), device=dev))
                        want = torch.arange(w, device=dev, dtype=torch.float32).repeat_interleave(chunk)
                        return bool(torch.equal(t, want))
                    src = torch.arange(w, device=dev, dtype=torch.float32).repeat_interleave(chunk) + r
                    t = torch.empty(chunk, device=dev)
                    dist.reduce_scatter_tensor(t, src)
                    return bool(torch.all(t == w * r + w * (w - 1) / 2))

                ok = run()  # warm-up and correctness
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    ok = run() and ok
                if env.cuda_available:
                    torch.cuda.synchronize()
                elapsed = (time.perf_counter() - t0) / iters
                flag = torch.tensor([1.0 if ok else 0.0], device=dev)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                nbytes = n * 4
                algbw = nbytes / elapsed / 1e9
                out.append({"op": op, "bytes": nbytes, "ok": bool(flag.item() == 1.0), "time_s": elapsed,
                            "algbw_GBps": algbw, "busbw_GBps": algbw * factor})  # fmt: skip
        return out
    finally:
        if own:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Presentation


def render(rep: dict, results: list[Check]) -> Any:
    from rich.console import Group
    from rich.table import Table

    info = Table(title="environment", show_header=False)
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


def render_comm(records: list[dict]) -> Any:
    from rich.table import Table

    t = Table(title="communication test")
    for col in ("op", "bytes", "ok", "ms", "algbw GB/s", "busbw GB/s"):
        t.add_column(col)
    for r in records:
        t.add_row(r["op"], f"{r['bytes']:,}", "yes" if r["ok"] else "NO", f"{r['time_s'] * 1e3:.3f}",
                  f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}")  # fmt: skip
    return t
