"""The one small interface every parallelism engine implements.

The training loop calls, per optimizer step::

    with strategy.micro_step(is_last):      # e.g. DDP's no_sync on accumulation micro-steps
        loss = strategy.model(**inputs)      # already divided by the global batch's target tokens
        strategy.backward(loss)
    grad_norm = strategy.step()              # clip, optimizer step, zero grads
    schedule.step()                          # the loop's learning-rate schedule (trainer/schedule.py)

and never branches on which engine runs; `protocol.LoopStrategy` lists everything it calls.
Strategies never parse YAML: they read the resolved :class:`~scaletune.resolve.RunSpec`.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from scaletune.models.loading import torch_dtype
from scaletune.strategies.devices import allow_tf32, check_devices
from scaletune.strategies.frozen_reference import resident_whole
from scaletune.strategies.memory import MemoryProbe
from scaletune.strategies.optim import apply_trainable, build_optimizer
from scaletune.strategies.process_group import WaitGroup, free_port, init_process_group

__all__ = ["Strategy", "check_devices", "free_port", "init_process_group"]

if TYPE_CHECKING:
    from scaletune.resolve import RunSpec


class Strategy(MemoryProbe, ABC):
    """Wraps a model and optimizer for one parallelism engine.

    Lifecycle: `setup()` -> (the model is loaded where `load_on_cpu` / `load_meta` say) ->
    `wrap(...)` -> per step `micro_step`/`backward`/`step` -> `export(...)` -> `teardown()`.
    """

    name: ClassVar[str]
    #: True if the engine moves the model itself (DeepSpeed, FSDP): load it on the CPU.
    engine_places_model: ClassVar[bool] = False
    #: True if the engine needs a process group even for one process (FSDP, DeepSpeed).
    needs_process_group: ClassVar[bool] = False
    #: How `save_state` writes: "dcp" (torch.distributed.checkpoint) or "deepspeed".
    checkpoint_format: ClassVar[str] = "dcp"

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.env = spec.env
        self.training = spec.config.training
        self.compute_dtype = torch_dtype(spec.precision.compute)
        self.storage_dtype = torch_dtype(spec.precision.storage)
        self.module: nn.Module | None = None  # the loss module handed to `wrap`
        self.model: nn.Module | None = None  # what forward is called on (possibly wrapped)
        self.optimizer: torch.optim.Optimizer | None = None
        self.reference: nn.Module | None = None  # the frozen reference model (`wrap_reference`)
        self._owns_group = False
        self._wait_group: WaitGroup | None = None
        self._grad_bytes: int | None = None
        #: fp16 outside DeepSpeed: dynamic loss scaling (`torch.amp.GradScaler`), built in `wrap`.
        self.scaler: Any = None
        #: True when the last `step` skipped the optimizer update (fp16 gradients overflowed): a bool,
        #: or with a loss scaler a 0-dim bool tensor on the device (read when the step is logged).
        self.skipped_step: bool | torch.Tensor = False
        #: Frozen weights a checkpoint holds anyway: they trained in an earlier stage
        #: (:meth:`keep_frozen`). Empty: checkpoints hold the trainable weights only.
        self.checkpointed_frozen: frozenset[str] = frozenset()
        self.log = logging.getLogger(__name__)

    # -- process group ---------------------------------------------------------------------
    #: True if the engine runs collectives on CPU tensors under NCCL (FSDP2 CPU offload).
    cpu_collectives: ClassVar[bool] = False

    def setup(self) -> None:
        d = self.spec.config.distributed
        self._owns_group = init_process_group(
            self.env,
            d.backend,
            d.timeout_minutes,
            even_alone=self.needs_process_group,
            cpu_collectives=self.cpu_collectives,
        )
        self._wait_group = WaitGroup.create(d.barrier_timeout_minutes)
        if self.env.cuda_available and self.compute_dtype != torch.float32:
            # Mixed precision: the few fp32 matmuls left (an fp32 head under autocast's exclusions,
            # the optimizer's) may use TF32 tensor cores. A float32 run keeps IEEE fp32 matmuls.
            allow_tf32()

    def teardown(self) -> None:
        self._wait_group = None
        if self._owns_group and dist.is_initialized():
            self.destroy_process_group()
            self._owns_group = False

    def destroy_process_group(self) -> None:
        """End the default group this strategy started (an engine that caches groups of its own
        releases them here too, so a later run in the same process starts clean)."""
        dist.destroy_process_group()

    def barrier(self) -> None:
        """Wait for every rank, typically while rank 0 works alone (tokenisation, checkpoint
        conversion, writing files). On the gloo wait group with `distributed.barrier_timeout_minutes`,
        never inside a collective of the training group (process_group.py says why)."""
        if self._wait_group is not None:
            self._wait_group.barrier()
        elif dist.is_initialized():
            dist.barrier()

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (identity at world size 1). Moves to the communication device."""
        if not dist.is_initialized():
            return value
        t = value.to(self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_reduce_data(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks that hold different data (all of them without a device mesh)."""
        return self.all_reduce_sum(value)

    def split_batch(self, micro_batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of a micro-batch its group shares (all of it without context parallelism)."""
        return micro_batch

    @property
    def comm_device(self) -> torch.device:
        return self.env.device

    @property
    def device(self) -> torch.device:
        """Where batches go."""
        return self.env.device

    @property
    def placement(self) -> Any:
        """Where the model loads (`models.DevicePlacement`): THE interpretation of `model.device_map`
        for this engine."""
        from scaletune.models.placement import resolve_device_map

        return resolve_device_map(
            self.spec.config.model.device_map, self.env, engine_places_model=self.engine_places_model
        )

    # -- model -----------------------------------------------------------------------------
    def load_meta(self) -> bool:
        """True if this rank should build the model on the meta device (`wrap` materialises it)."""
        return False

    def loading_alone(self) -> contextlib.AbstractContextManager:  # no hooks to withdraw (ZeRO-3 has some)
        return contextlib.nullcontext()

    #: True if the engine gathers the output head's weight inside each call of the head (ZeRO-3):
    #: the loss must then call the head once per micro-batch, whatever its number of targets.
    partitions_head: ClassVar[bool] = False

    @abstractmethod
    def wrap(self, module: nn.Module) -> None:
        """Wrap `module` (a `loss.CausalLMLoss`: forward returns the summed token loss) for the
        engine, set `self.module`, `self.model` and build the optimizer (then call
        :meth:`_finish_wrap`). The loop's schedule drives the optimizer's learning rate."""

    def wrap_reference(self, model: nn.Module) -> nn.Module:
        """The frozen reference model (`preference.reference: model`) made resident as this engine keeps
        the policy, without optimizer or gradient hooks (`strategies/frozen_reference.py`); here: whole on this
        rank's device. Returns the `reference.FrozenReference` the loss calls under no_grad.

        Raises:
            RuntimeError: the model is on the meta device."""
        self.reference = resident_whole(model, self.device)
        return self.reference

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(model, self.training)

    def retarget(self, trainable: frozenset[str]) -> None:
        """Train exactly the parameters named in `trainable` (as `self.module` names them) from now
        on: `requires_grad` set, the optimizer rebuilt over them (fresh AdamW state) and whatever the
        engine derived from the trainable set rebuilt with it. Every rank calls it at once (a stage
        boundary). The loop's schedule moves to the new optimizer afterwards."""
        assert self.module is not None
        apply_trainable(self.module, trainable)
        self.optimizer = self.build_optimizer(self.module)
        self._grad_bytes = None  # measured again at the new optimizer's first step
        self._track_gradients()

    def keep_frozen(self, names: frozenset[str]) -> None:
        """From now on checkpoints also hold the frozen weights in `names` (full names of the loss
        module's parameters that trained in an earlier stage; `trainer.freezing` decides them)."""
        self.checkpointed_frozen = names

    def move_batch(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Put a micro-batch's tensors on this rank's device (other values pass through)."""
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in inputs.items()}

    @property
    def unwrapped(self) -> nn.Module:
        """The Hugging Face (or peft) model, or the factory's module, inside the engine's wrapper and the loss module."""
        assert self.module is not None
        return self.module.causal_lm if hasattr(self.module, "causal_lm") else self.module.model

    # -- one optimizer step ----------------------------------------------------------------
    def forward_context(self) -> contextlib.AbstractContextManager:
        """Autocast to the compute dtype where the resolved precision says so."""
        if self.spec.precision.autocast:
            return torch.autocast(self.env.device_type, dtype=self.compute_dtype)
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
        loss = loss * self.grad_divisor
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def forward_backward(self, inputs: list[dict], denominator: torch.Tensor, each: Any = None) -> torch.Tensor:
        """Forward and backward of a step's micro-batches (`inputs`: the loss module's keyword
        arguments, on the host), each loss divided by `denominator` (the global target counts);
        `each(i)` after micro-batch i. Returns the sum of the divided losses (0-dim float32)."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for i, x in enumerate(inputs):
            with self.micro_step(is_last=i == len(inputs) - 1):
                with self.forward_context():
                    loss = (self.model(**self.move_batch(x)) / denominator).sum()  # type: ignore[misc]
                self.backward(loss)
            total += loss.detach()
            if each is not None:
                each(i)
        return total

    @property
    def eval_group(self) -> int:
        """Micro-batches per `forward_only` call in evaluation (a pipeline's stage count; else 1)."""
        return 1

    def forward_only(self, inputs: list[dict]) -> torch.Tensor:
        """The summed loss of `inputs` (no gradients)."""
        with torch.no_grad(), self.forward_context():
            return sum(self.model(**self.move_batch(x)) for x in inputs)  # type: ignore[misc,return-value]

    def make_scaler(self) -> Any:
        """`torch.amp.GradScaler` where the run computes in float16 (DeepSpeed scales its own loss), else
        None: fp16's 5 exponent bits flush small gradients to zero, so the loss is scaled before backward
        and the gradients unscaled before clipping; an overflowing step is skipped and the scale halved
        (Micikevicius et al. 2018, arXiv:1710.03740)."""
        if self.compute_dtype != torch.float16:
            return None
        return torch.amp.GradScaler(self.env.device_type)

    def step(self) -> torch.Tensor:
        """Clip (if `max_grad_norm`), step the optimizer, zero grads. With a loss scaler the
        gradients are unscaled first, and an overflowing step skips the update (`skipped_step`).
        The learning-rate schedule is the loop's (it steps it right after, skipped step or not).

        Returns:
            The total gradient norm before clipping, a 0-dim tensor. No host sync here, scaler or
            not: the skip decision stays a tensor too (`skipped_step`), read when the step is logged.
        """
        assert self.optimizer is not None and self.model is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.training.max_grad_norm
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = self.clip_grad_norm(params, max_norm if max_norm is not None else float("inf"))
        if self.scaler is not None:
            # The scale tensor itself, copied on its device: `get_scale()` would read it to the host,
            # a sync at every step (twice), though only logged steps report the skip. With a fused
            # AdamW, `scaler.step` hands it the inf flag on the device and syncs nothing either.
            scale = self.scaler._get_scale_async().clone()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            # update() backs the scale off (in place) exactly when step() found inf/NaN gradients and
            # skipped: a 0-dim bool tensor on the device.
            self.skipped_step = self.scaler._get_scale_async() < scale
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """The total gradient norm of `params` before clipping, their gradients scaled to at most
        `max_norm` (inf: measured only): torch's `clip_grad_norm_`. An engine whose gradients lie on
        several meshes or pipeline stages replaces it (`FSDPStrategy`: its step runner's)."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def lr(self) -> float:
        assert self.optimizer is not None
        return float(self.optimizer.param_groups[0]["lr"])

    def train_mode(self, on: bool) -> None:
        assert self.model is not None
        self.model.train(on)

    def _finish_wrap(self) -> None:
        """What every engine does at the end of `wrap`: the loss scaler, the gradient-bytes probe, and
        the device's peak-memory counter reset, so `peak_device` measures training, not loading
        (rank 0 of FSDP holds the whole model before sharding it)."""
        self.scaler = self.make_scaler()
        self._track_gradients()
        for device in self.memory_devices():
            torch.cuda.reset_peak_memory_stats(device)

    # -- checkpoint state ------------------------------------------------------------------
    def _state_options(self, **kw: Any) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # Frozen weights (a LoRA base) come from model.name_or_path, not from the checkpoint.
        return StateDictOptions(ignore_frozen_params=not self.checkpointed_frozen, **kw)

    def _checkpointed(self, model_sd: dict) -> dict:
        """The weights a checkpoint holds: the trainable ones, the `checkpointed_frozen` ones, buffers."""
        if not self.checkpointed_frozen:
            return model_sd
        assert self.module is not None
        params = {n: p.requires_grad for n, p in self.module.named_parameters(remove_duplicate=False)}
        return {k: v for k, v in model_sd.items() if params.get(k, True) or k in self.checkpointed_frozen}

    def prepare_resume(self, path: Path, world_size: int) -> None:  # noqa: B027 - a hook; most engines need none
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
        dcp.save({"model": self._checkpointed(model_sd), "optim": optim_sd}, checkpoint_id=str(path / "state"))

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Global shapes of the trainable weights as `save_state` names them (for resume checks)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.module is not None
        sd = self._checkpointed(get_model_state_dict(self.module, options=self._state_options()))
        return {f"model.{k}": tuple(v.shape) for k, v in sd.items()}

    def load_state(self, path: Path) -> None:
        """Read what `save_state` wrote (possibly at another world size) into model and optimizer."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from scaletune.safe_load import dcp_reader

        assert self.module is not None and self.optimizer is not None
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=self._state_options())
        state = {"model": self._checkpointed(model_sd), "optim": optim_sd}
        dcp.load(state, storage_reader=dcp_reader(path / "state"))
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self._state_options(strict=False),
        )

    # -- export ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights (gathered where sharded) keyed as in `self.module`, on
        rank 0; None on other ranks. A collective where the engine shards."""
        assert self.module is not None
        return self.module.state_dict() if self.env.is_main else None

    def export(self, out_dir: Path, trained_base: frozenset[str] = frozenset()) -> None:
        """Write a Hugging Face folder (safetensors; for LoRA the adapter, with the base weights
        named in `trained_base`, names as in `self.module`: `models.adapters.save_adapter`) on rank 0."""
        self._write_export(out_dir, self.full_state_dict(), trained_base)

    def _write_export(
        self, out_dir: Path, state: dict[str, torch.Tensor] | None, trained_base: frozenset[str] = frozenset()
    ) -> None:
        if self.env.is_main:
            assert state is not None
            if hasattr(self.module, "save_export"):  # a factory's module: safetensors + its reference
                self.module.save_export(out_dir, state)
            else:
                from peft import PeftModel

                from scaletune.models.adapters import save_adapter, trained_base_weights

                prefix = "causal_lm."
                state = {k.removeprefix(prefix): v.detach().to("cpu") for k, v in state.items()}
                if isinstance(self.unwrapped, PeftModel):
                    names = trained_base_weights(self.unwrapped, (n.removeprefix(prefix) for n in trained_base))
                    save_adapter(self.unwrapped, out_dir, state, names)
                else:
                    self.unwrapped.save_pretrained(str(out_dir), state_dict=state)  # safetensors
        self.barrier()

    def describe(self) -> str:
        precision = self.spec.precision.describe(self.name, self.spec.config.model.mixed_precision)
        return f"strategy {self.name}, world_size {self.env.world_size}, {precision}"
