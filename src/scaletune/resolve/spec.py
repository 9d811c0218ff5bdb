"""The resolved run and its parts: :class:`RunSpec` and what it holds (precision, batch arithmetic,
stages), and the planner's :class:`AutoChoice` (a rule's :class:`Problem` lives in `errors.py`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from scaletune.config import Config, DataConfig, TrainingConfig
from scaletune.env import DistributedEnv
from scaletune.errors import Problem

StrategyName = Literal["single", "ddp", "fsdp", "deepspeed"]

#: THE floating-point dtypes a run names (torch's names: `torch.bfloat16`) -> (bytes per element,
#: the short name of DeepSpeed's JSON and of `scaletune export --dtype`). torch's side of the map is
#: :func:`scaletune.models.loading.torch_dtype`.
FLOAT_DTYPES: dict[str, tuple[int, str]] = {"float32": (4, "fp32"), "bfloat16": (2, "bf16"), "float16": (2, "fp16")}


@dataclass(frozen=True)
class AutoChoice:
    """What `distributed.strategy: auto` became, and why (the planner's answer)."""

    strategy: StrategyName
    reason: str
    zero_stage: int | None = None
    offload_optimizer: bool = False
    offload_params: bool = False

    @staticmethod
    def default(world_size: int) -> AutoChoice:
        """The choice without a memory plan: one process trains alone, several with DDP."""
        if world_size > 1:
            return AutoChoice("ddp", f"{world_size} ranks and no device memory to plan with: data parallelism")
        return AutoChoice("single", "one process")


@dataclass(frozen=True)
class CheckpointingChoice:
    """What `model.gradient_checkpointing: auto` became, and why (the planner's answer)."""

    enabled: bool
    reason: str

    @staticmethod
    def unplanned() -> CheckpointingChoice:
        """The choice where no planner was asked (a run decided without one: the memory-safe side)."""
        return CheckpointingChoice(True, "not planned")


@dataclass(frozen=True)
class Precision:
    """How a run stores and computes (dtype names, torch-free).

    Attributes:
        compute: dtype of the forward and backward matmuls (`model.dtype`, `auto` resolved).
        storage: dtype the weights are loaded in. Trainable weights stay float32 (master weights,
            as HF Trainer with `bf16=True` and DeepSpeed/FSDP mixed precision keep them); only a
            frozen LoRA base is stored in the compute dtype.
        autocast: the loop runs the forward under `torch.autocast(compute)`; engines that cast
            themselves (FSDP2's MixedPrecisionPolicy, DeepSpeed) do not need it.
        cast_params: single/ddp with `model.mixed_precision: bf16_params`: the strategy computes with
            compute-dtype copies of the float32 master weights (FSDP2's MixedPrecisionPolicy on a
            replicate mesh), so the residual stream is in the compute dtype. fsdp and deepspeed always
            cast their parameters; it stays False there.
    """

    compute: str
    storage: str
    autocast: bool
    cast_params: bool = False

    @property
    def mixed(self) -> bool:
        return self.compute != self.storage

    def describe(self, engine: str, mixed_precision: str) -> str:
        """The precision as the run summary prints it (`engine`: the strategy's name, `mixed_precision`:
        `model.mixed_precision`)."""
        if self.cast_params:
            return f"{self.compute} parameter copies (model.mixed_precision bf16_params), float32 master weights and gradient reduction"
        if not self.mixed:
            return self.compute
        out = f"{self.compute} compute, {self.storage} master weights" + (", autocast" if self.autocast else "")
        if mixed_precision == "bf16_params":  # fsdp, deepspeed
            out += f" (model.mixed_precision bf16_params: {engine}'s mixed precision casts the parameters anyway)"
        return out


MESH_DIMS = ("pipeline", "data_shard", "context", "tensor")


@dataclass(frozen=True)
class Mesh:
    """The device mesh `(pipeline, data_shard, context, tensor)`: its degrees, tensor innermost (the
    ranks of one tensor group are neighbours, on one node where possible), as torchtitan orders it.

    `data_shard` is the rest of the world size. The ranks of one context or tensor group read the
    same micro-batches; only `data_shard` splits the data (and the batch arithmetic counts it alone).
    """

    pipeline: int = 1
    data_shard: int = 1
    context: int = 1
    tensor: int = 1

    @property
    def world_size(self) -> int:
        return self.pipeline * self.data_shard * self.context * self.tensor

    @property
    def model_parallel(self) -> bool:
        """Some degree other than data is above 1."""
        return self.pipeline * self.context * self.tensor > 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pipeline, self.data_shard, self.context, self.tensor)

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s index along each dimension (row-major over :data:`MESH_DIMS`)."""
        out, rest = {}, rank
        for name, size in reversed(list(zip(MESH_DIMS, self.shape))):
            out[name] = rest % size
            rest //= size
        return {name: out[name] for name in MESH_DIMS}

    def data_rank(self, rank: int) -> int:
        """Which share of the data `rank` reads: its `data_shard` index."""
        return self.coordinates(rank)["data_shard"]

    def describe(self) -> str:
        parts = [f"{name} {size}" for name, size in zip(MESH_DIMS, self.shape) if size > 1 or name == "data_shard"]
        return f"world_size {self.world_size} = " + " x ".join(parts)


@dataclass(frozen=True)
class BatchArithmetic:
    """How a global batch is split: `global_batch_size = micro_batch_size x data-parallel ranks x
    gradient_accumulation_steps`. `world_size` here counts the data-parallel ranks (the mesh's
    `data_shard` degree): the ranks of one tensor, context or pipeline group share their micro-batches."""

    global_batch_size: int
    micro_batch_size: int
    world_size: int
    gradient_accumulation_steps: int
    max_seq_length: int
    mesh: Mesh | None = None

    @property
    def max_tokens_per_step(self) -> int:
        """Upper bound of tokens per optimizer step (all ranks): sequences x max_seq_length."""
        return self.global_batch_size * self.max_seq_length

    def describe(self) -> str:
        ranks = f"world_size {self.world_size}"
        note = ""
        if self.mesh is not None and self.mesh.model_parallel:
            ranks = f"data-parallel ranks {self.world_size}"
            note = f"; {self.mesh.describe()}: batch sizes count data-parallel ranks only"
        return (
            f"global_batch_size {self.global_batch_size} = micro_batch_size {self.micro_batch_size}"
            f" x {ranks} x gradient_accumulation_steps "
            f"{self.gradient_accumulation_steps}; at most {self.max_tokens_per_step:,} tokens per step "
            f"(max_seq_length {self.max_seq_length}){note}"
        )


@dataclass(frozen=True)
class Stage:
    """One curriculum stage with the top level's data and training merged under its own keys.

    `trainable` / `frozen`: the stage's glob patterns over parameter names (None: not given);
    `freezing.trainable_names` turns them into the set of parameters that train.
    """

    index: int
    name: str
    data: DataConfig
    training: TrainingConfig
    continue_schedule: bool
    trainable: tuple[str, ...] | None = None
    frozen: tuple[str, ...] | None = None


@dataclass(frozen=True)
class RunSpec:
    """Everything decided about a run (see the module docstring).

    Attributes:
        config: the resolved config: `distributed` holds the decided strategy, ZeRO stage and
            offload, `training.resume` the resume request (what `config.yaml` records).
        env: the process's launch environment.
        world_size: ranks of the job (a plain process that re-executes under torchrun counts the
            ranks it will start).
        strategy, zero_stage, offload_optimizer, offload_params: the engine and its settings.
        requested: the strategy the config asked for (`auto` or a name).
        reason: why this strategy (the planner's reason for `auto`).
        precision: storage and compute dtypes.
        batch: the first stage's batch arithmetic (batch sizes are the same in every stage).
        stages: the resolved curriculum (one stage named `main` without `stages:`).
        resume_from: the checkpoint to resume from, or None.
        max_positions: the model's position limit, where known.
        mesh: the device mesh's degrees (all 1 but data_shard without model parallelism).
        checkpointing_reason: why `model.gradient_checkpointing` is what `config` holds (the
            planner's reason for `auto`).
    """

    config: Config
    env: DistributedEnv
    world_size: int
    strategy: StrategyName
    zero_stage: int
    offload_optimizer: bool
    offload_params: bool
    requested: str
    reason: str
    precision: Precision
    batch: BatchArithmetic
    stages: tuple[Stage, ...]
    resume_from: Path | None = None
    max_positions: int | None = None
    mesh: Mesh = Mesh()
    checkpointing_reason: str = "configured"

    @property
    def run_dir(self) -> Path:
        return Path(self.config.output_dir)

    @property
    def shards_params(self) -> bool:
        """FSDP or ZeRO-3: parameters partitioned over ranks."""
        return self.strategy == "fsdp" or (self.strategy == "deepspeed" and self.zero_stage == 3)

    @property
    def custom_model(self) -> bool:
        """The model comes from `model.factory` (your own module), not `from_pretrained`."""
        return self.config.model.factory is not None

    @property
    def packs(self) -> bool:
        """Some stage packs its rows (`data.packing`)."""
        return any(stage.data.packing for stage in self.stages)

    @property
    def freezes_per_stage(self) -> bool:
        """Some stage names what trains (`trainable` / `frozen`)."""
        return any(s.trainable is not None or s.frozen is not None for s in self.stages)

    @property
    def strategy_label(self) -> str:
        """`ddp`, `fsdp`, `deepspeed zero_stage 3`: the strategy as messages name it."""
        return f"deepspeed zero_stage {self.zero_stage}" if self.strategy == "deepspeed" else self.strategy

    def batch_for(self, stage: Stage) -> BatchArithmetic:
        return dataclasses.replace(self.batch, max_seq_length=stage.data.max_seq_length)


def batch_problem(global_batch_size: int, micro_batch_size: int, world_size: int) -> Problem | None:
    """`global_batch_size` must split into whole micro-batches on every data-parallel rank (`world_size`:
    the data-parallel ranks, the whole world without a device mesh)."""
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step == 0:
        return None
    lower = (global_batch_size // per_step) * per_step
    hint = f"{lower} or {lower + per_step}" if lower else f"{per_step}"
    return Problem(
        "batch arithmetic",
        "training.global_batch_size",
        f"training.global_batch_size ({global_batch_size}) must be a multiple of micro_batch_size x world_size "
        f"({micro_batch_size} x {world_size} = {per_step})",
        f"use for example {hint}",
    )


def batch_arithmetic(
    training: TrainingConfig, world_size: int, max_seq_length: int, mesh: Mesh | None = None
) -> BatchArithmetic:
    """THE gradient-accumulation rule: `global_batch_size` split over `world_size` data-parallel ranks
    (floor division; :func:`batch_problem` judges a remainder, so deciding never fails)."""
    gas = training.global_batch_size // (training.micro_batch_size * world_size)
    return BatchArithmetic(training.global_batch_size, training.micro_batch_size, world_size, gas, max_seq_length, mesh)
