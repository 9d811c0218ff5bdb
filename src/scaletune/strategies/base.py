"""The one small interface every parallelism engine implements.

The training loop calls, per optimizer step::

    with strategy.micro_step(is_last):      # e.g. DDP's no_sync on accumulation micro-steps
        loss = loss_fn(strategy.model(...))  # already divided by the global batch's target tokens
        strategy.backward(loss)
    grad_norm = strategy.step()              # clip, optimizer step, scheduler step, zero grads

and never branches on which engine runs. Strategies never parse YAML: they receive the typed
config sections and the `DistributedEnv`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator

import torch
import torch.distributed as dist
from torch import nn

from scaletune.config import BatchArithmetic, DistributedConfig, ModelConfig, TrainingConfig
from scaletune.env import DistributedEnv, get_logger

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """How a run stores and computes.

    Attributes:
        compute: dtype of matmuls in forward/backward (`model.dtype`).
        storage: dtype the weights are loaded in. Trainable weights stay float32 (master
            weights, as HF Trainer with `bf16=True` and DeepSpeed/FSDP mixed precision keep them);
            only a frozen LoRA base is stored in the compute dtype.
    """

    compute: torch.dtype
    storage: torch.dtype

    @property
    def mixed(self) -> bool:
        return self.compute != self.storage


def resolve_precision(model: ModelConfig, env: DistributedEnv) -> Precision:
    """`model.dtype` -> compute and storage dtypes. `auto`: bfloat16 on a GPU that supports it,
    else float32."""
    name = model.dtype
    if name == "auto":
        name = "bfloat16" if env.cuda_available and torch.cuda.is_bf16_supported() else "float32"
    compute = _DTYPES[name]
    frozen_base = model.lora is not None
    storage = compute if frozen_base else torch.float32
    return Precision(compute=compute, storage=storage)


def init_process_group(env: DistributedEnv, cfg: DistributedConfig, *, even_alone: bool = False) -> bool:
    """Start the default process group for a launched multi-rank job: NCCL on CUDA, gloo on CPU.

    `even_alone`: also start a group of one for a plain single process (FSDP and DeepSpeed need a
    group at world size 1), on a free loopback port.

    Returns True if this call created it (and so must destroy it).

    Raises:
        RuntimeError: the launcher did not set MASTER_ADDR/MASTER_PORT.
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
    backend = cfg.backend
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
    timeout = datetime.timedelta(minutes=cfg.timeout_minutes)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps one store across restarts: without a per-attempt prefix, restarted ranks
        # read the addresses the killed ranks published and gloo fails with "connectFullMesh ...
        # Connection refused" (pytorch#167288).
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
        kwargs["store"] = dist.PrefixStore(f"scaletune/attempt-{attempt}", store)
    dist.init_process_group(
        backend=backend,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        **kwargs,
    )
    return True


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_devices(module: nn.Module, expected: torch.device | str, *, strategy: str, limit: int = 5) -> None:
    """Every parameter and buffer of `module` must be on `expected` before the engine wraps it.

    Catches the engines' "module must have its parameters and buffers on device cuda:0 ... found
    one of them on device: cpu" before they raise it, naming the first offending tensors.

    Raises:
        RuntimeError: naming up to `limit` tensors and their devices, and the fix.
    """
    want = torch.device(expected)
    bad = []
    for kind, items in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in items:
            d = t.device
            if d.type != want.type or (want.index is not None and d.index not in (None, want.index)):
                bad.append(f"{kind} {name} on {d}")
    if bad:
        more = f" and {len(bad) - limit} more" if len(bad) > limit else ""
        raise RuntimeError(
            f"strategy {strategy} expects every parameter and buffer on {want}, found "
            f"{'; '.join(bad[:limit])}{more}. This usually comes from device_map splitting the model "
            "or a module created after loading: load without device_map under a launcher, or move the "
            "module to the rank's device before training."
        )


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no decay on biases and norm weights (ndim < 2), as in GPT-2/nanoGPT/HF Trainer."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


class Strategy(ABC):
    """Wraps a model and optimizer for one parallelism engine.

    Lifecycle: `setup()` -> `placement()` (where models.py loads the model) -> `wrap(...)` ->
    per step `micro_step`/`backward`/`step` -> `export(...)` -> `teardown()`.
    """

    name: ClassVar[str]
    #: True if the engine moves the model itself (DeepSpeed): load it on the CPU.
    engine_places_model: ClassVar[bool] = False
    #: True if the engine needs a process group even for one process (FSDP, DeepSpeed).
    needs_process_group: ClassVar[bool] = False

    def __init__(
        self,
        env: DistributedEnv,
        dist_cfg: DistributedConfig,
        model_cfg: ModelConfig,
        training: TrainingConfig,
        batch: BatchArithmetic,
    ) -> None:
        self.env = env
        self.dist_cfg = dist_cfg
        self.model_cfg = model_cfg
        self.training = training
        self.batch = batch
        self.precision = resolve_precision(model_cfg, env)
        self.module: nn.Module | None = None  # the CausalLMLoss handed to `wrap`
        self.model: nn.Module | None = None  # what forward is called on (possibly wrapped)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self._owns_group = False
        self.log = get_logger()

    # -- process group ---------------------------------------------------------------------
    def setup(self) -> None:
        self._owns_group = init_process_group(self.env, self.dist_cfg, even_alone=self.needs_process_group)

    def teardown(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (identity at world size 1). Moves to the communication device."""
        if not dist.is_initialized():
            return value
        t = value.to(self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    @property
    def comm_device(self) -> torch.device:
        return self.env.device

    @property
    def device(self) -> torch.device:
        """Where batches go."""
        return self.env.device

    # -- model -----------------------------------------------------------------------------
    def load_meta(self) -> bool:
        """True if the model should be built on the meta device and materialised by `wrap`."""
        return False

    @abstractmethod
    def wrap(self, module: nn.Module) -> None:
        """Wrap `module` (a `loss.CausalLMLoss`: forward returns the summed token loss) for the
        engine, set `self.module`, `self.model` and build the optimizer. The loop sets
        `scheduler` (per stage)."""

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """AdamW over :func:`param_groups`, fused where every parameter is on the CPU or a CUDA device."""
        t = self.training
        groups = param_groups(model, t.weight_decay)
        # Fused AdamW: one kernel over all tensors, on CUDA and (torch >= 2.4) on the CPU, where
        # torch's default is the per-tensor loop: 13M parameters step in 9 ms fused, 30 ms foreach,
        # 75 ms per tensor (2 cores). HF Trainer's default optimizer is the same fused AdamW.
        fused = {p.device.type for g in groups for p in g["params"]} <= {"cpu", "cuda"}
        return torch.optim.AdamW(
            groups,
            lr=t.learning_rate,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_epsilon,
            fused=fused or None,
        )

    @property
    def unwrapped(self) -> nn.Module:
        """The Hugging Face (or peft) model inside the engine's wrapper and the loss module."""
        assert self.module is not None
        return self.module.causal_lm

    # -- one optimizer step ----------------------------------------------------------------
    def forward_context(self) -> contextlib.AbstractContextManager:
        """Autocast to the compute dtype when weights are stored in a wider one."""
        if self.precision.mixed:
            return torch.autocast(self.env.device_type, dtype=self.precision.compute)
        return contextlib.nullcontext()

    def micro_step(self, is_last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's forward and backward; `is_last` ends the accumulation."""
        return contextlib.nullcontext()

    #: The factor the engine divides summed gradients by (DDP and FSDP average over ranks).
    #: `backward` multiplies it back in so the step's gradient is d(global mean token loss).
    @property
    def grad_divisor(self) -> float:
        return 1.0

    def backward(self, loss: torch.Tensor) -> None:
        """`loss`: this micro-batch's summed token loss divided by the global batch's target tokens."""
        (loss * self.grad_divisor).backward()

    def step(self) -> torch.Tensor:
        """Clip (if `max_grad_norm`), step optimizer and scheduler, zero grads.

        Returns:
            The total gradient norm before clipping, a 0-dim tensor (no host sync here).
        """
        assert self.optimizer is not None and self.model is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.training.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def lr(self) -> float:
        assert self.optimizer is not None
        return float(self.optimizer.param_groups[0]["lr"])

    def train_mode(self, on: bool) -> None:
        assert self.model is not None
        self.model.train(on)

    # -- checkpoint state ------------------------------------------------------------------
    #: How `save_state` writes: "dcp" (torch.distributed.checkpoint) or "deepspeed".
    checkpoint_format: ClassVar[str] = "dcp"

    def _state_options(self, **kw: Any) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # Frozen weights (a LoRA base) come from model.name_or_path, not from the checkpoint.
        return StateDictOptions(ignore_frozen_params=True, **kw)

    def prepare_resume(self, path: Path, world_size: int) -> None:
        """Called before `wrap` when resuming from `path`, written by `world_size` ranks."""

    def save_state(self, path: Path) -> None:
        """Write model (trainable weights) and optimizer state under `path`, sharded as the
        engine shards: every rank writes its own shard (a collective).

        DCP stores each tensor with its global shape, so `load_state` reshards to any world size.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        assert self.module is not None and self.optimizer is not None
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=self._state_options())
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "state"))

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Global shapes of the trainable weights as `save_state` names them (for resume checks)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.module is not None
        sd = get_model_state_dict(self.module, options=self._state_options())
        return {f"model.{k}": tuple(v.shape) for k, v in sd.items()}

    def load_state(self, path: Path) -> None:
        """Read what `save_state` wrote (possibly at another world size) into model and optimizer."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        assert self.module is not None and self.optimizer is not None
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=self._state_options())
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path / "state"))
        set_state_dict(
            self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
            options=self._state_options(strict=False),
        )

    # -- export ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights (gathered where sharded) keyed as in `self.module`, on
        rank 0; None on other ranks. A collective where the engine shards."""
        assert self.module is not None
        return self.module.state_dict() if self.env.is_main else None

    def export(self, out_dir: Path) -> None:
        """Write a Hugging Face folder (safetensors; the adapter only for LoRA) on rank 0."""
        state = self.full_state_dict()
        if self.env.is_main:
            assert state is not None
            prefix = "causal_lm."
            state = {k.removeprefix(prefix): v.detach().to("cpu") for k, v in state.items()}
            self.unwrapped.save_pretrained(str(out_dir), state_dict=state)  # safetensors
        self.barrier()

    def describe(self) -> str:
        p = self.precision
        prec = f"{str(p.compute).removeprefix('torch.')}"
        if p.mixed:
            prec += f" compute, {str(p.storage).removeprefix('torch.')} master weights"
        return f"strategy {self.name}, world_size {self.env.world_size}, {prec}"


@contextlib.contextmanager
def torn_down(strategy: Strategy) -> Iterator[Strategy]:
    """Set up the strategy and tear its process group down on exit and on error."""
    strategy.setup()
    try:
        yield strategy
    finally:
        strategy.teardown()
