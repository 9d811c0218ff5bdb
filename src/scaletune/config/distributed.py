"""The `distributed:` section: processes, the parallel strategy and the device mesh."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from scaletune.config.strict import StrictModel


class DistributedConfig(StrictModel):
    """How the work is spread over processes and devices."""

    strategy: Literal["auto", "single", "ddp", "fsdp", "deepspeed"] = "auto"
    """single: one process; ddp: full replica per rank; fsdp: FSDP2 sharding; deepspeed: ZeRO
    `zero_stage`; auto: the memory planner picks the fastest that fits (single on one process)."""
    num_processes: Literal["auto"] | int = "auto"
    """Processes a plain `scaletune train` starts (re-executing under torchrun); auto: one per visible
    GPU. Under a launcher the launcher decides."""
    zero_stage: int = Field(2, ge=1, le=3)
    """DeepSpeed ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters
    (Rajbhandari et al. 2020, arXiv:1910.02054)."""
    offload_optimizer: bool = False
    """DeepSpeed: optimizer state and step on the CPU (ZeRO-Offload)."""
    offload_params: bool = False
    """Parameters on the CPU: DeepSpeed ZeRO-3, or FSDP (which then offloads gradients and optimizer state too)."""
    reshard_after_forward: bool = True
    """FSDP2: free each layer's gathered parameters after its forward (ZeRO-3-like) or keep them until
    backward (ZeRO-2-like: more memory, one all-gather less)."""
    deepspeed_config: str | None = None
    """A DeepSpeed JSON of your own, merged under the generated one; its batch, precision and stage
    keys must agree with the YAML or be `auto`."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend: auto is NCCL on GPUs, gloo on CPUs."""
    timeout_minutes: float = Field(30, gt=0)
    """Collective timeout (the NCCL watchdog's), in minutes."""
    barrier_timeout_minutes: float = Field(360, gt=0)
    """How long the other ranks wait, in minutes, while rank 0 works alone (tokenising the data,
    converting a checkpoint, writing checkpoints and the exported model). They wait in a gloo barrier,
    outside the collectives `timeout_minutes` watches; a rank that dies still ends the job at once
    through the launcher."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for every rank (e.g. NCCL_DEBUG: INFO). Secret values (names with
    TOKEN, SECRET, PASSWORD, KEY, ... or listed in `secret_env`) are never written to a file, a log
    or a script: they reach the ranks through the environment."""
    secret_env: list[str] = Field(default_factory=list)
    """Names of environment variables that hold secrets although their names do not say so; their
    values in `env` are redacted like HF_TOKEN's."""

    tensor_parallel: int = Field(1, ge=1)
    """Tensor parallelism degree (Megatron-LM's layer split, Shoeybi et al. 2019, arXiv:1909.08053) by
    DTensor: each attention and MLP projection is split over this many ranks (column- then row-wise),
    and the output head over the vocabulary with a loss-parallel cross-entropy, so the full logits
    never exist on one rank. Needs `strategy: fsdp` (or auto); it must divide the attention heads,
    key-value heads and MLP width. 1: off."""
    context_parallel: int = Field(1, ge=1)
    """Context (sequence) parallelism degree: each sequence is split into this many slices along its
    length, one per rank, and attention stays exact by an all-to-all that trades the sequence split
    for a split over heads around each attention call (DeepSpeed-Ulysses, Jacobs et al. 2023,
    arXiv:2309.14509). Activations per rank shrink by the degree. Needs `strategy: fsdp` (or auto);
    it must divide the attention and key-value heads left after tensor parallelism, and
    `data.max_seq_length`; models with sliding-window or chunked attention are refused. 1: off."""
    pipeline_parallel: int = Field(1, ge=1)
    """Pipeline parallelism degree: the decoder layers split into this many consecutive stages, one
    per rank of a pipeline group (torch.distributed.pipelining, the 1F1B schedule of Narayanan et al.
    2021, arXiv:2104.04473), the micro-batches of each step streamed through them; the data ranks of
    each stage shard it with FSDP2. Needs `strategy: fsdp` (or auto), at least this many micro-batches
    per step and rank, a layer count it divides, an untied head; not combined with tensor or context
    parallelism, activation offload or fp16 in this version. 1: off."""

    @field_validator("num_processes")
    @classmethod
    def _nproc(cls, v: Any) -> Any:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be auto or a positive integer")
        return v
