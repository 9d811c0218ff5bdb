"""The memory planner: bytes per rank of every strategy, from the model's config alone.

`scaletune plan` and `distributed.strategy: auto` build the model on the meta device (no weights,
no storage), count its parameters exactly (LoRA adapters included, injected by peft on the meta
device too) and compute, for each strategy, what one rank holds:

Model states (ZeRO paper, Rajbhandari et al. 2020, arXiv:1910.02054, section 3 and figure 1:
mixed-precision Adam holds 2Ψ fp16 parameters + 2Ψ fp16 gradients + KΨ optimizer state with
K = 12: fp32 master weights, momentum and variance; stage 1 partitions the K part over the N_d
ranks, stage 2 also the gradients, stage 3 also the parameters). scaletune's own numbers differ
from the textbook's and the planner counts scaletune's (`strategies/base.py` `Precision`):

* single / ddp / fsdp keep trainable weights in float32 (master weights) and compute under
  autocast (single, ddp) or FSDP2's `MixedPrecisionPolicy` (fsdp; single/ddp with `bf16_params`,
  whose bf16 copies of the root and two layers are in the working margin): parameters 4 bytes, gradients
  4 bytes (fp32 params get fp32 grads), AdamW `exp_avg` + `exp_avg_sq` 8 bytes, plus one 4-byte
  `step` tensor per parameter tensor. 16 bytes per trainable parameter, like the paper's 2+2+12.
  ddp replicates all of it; fsdp shards every tensor on dim 0 (`ceil(d0 / W)` rows on rank 0).
* DeepSpeed casts the module to the compute dtype (bf16: 2 bytes; fp32 on CPU: 4 bytes) and keeps
  an fp32 partition of the trainable parameters (ZeRO-1/2: a clone, even when the module is fp32;
  ZeRO-3: a clone only when the module is not fp32) plus Adam's two fp32 moments in the optimizer: ZeRO-1/2 hold the whole module (b_c Ψ) and 12 Ψ_t / W of
  optimizer state; ZeRO-3 holds b_c Ψ / W of parameters (each tensor padded to a multiple of W;
  tensors smaller than `stage3_param_persistence_threshold` (1e5 elements) are also kept whole on
  every rank) and the same 12 Ψ_t / W.
* "grads" is what the optimizer steps on (measured at the optimizer step): fp32 gradients of the
  trainable parameters, replicated (single, ddp), sharded (fsdp) or one fp32 partition of 4 Ψ_t / W
  (ZeRO 1-3; DeepSpeed 0.19 frees the full-size low-precision gradients before it, ZeRO-3 also keeps
  a partitioned accumulation buffer of b_c Ψ_t / W). The engines' transient buffers (ZeRO-1's
  full-size gradients before the reduce-scatter, DeepSpeed's `reduce_bucket_size` buckets, FSDP's
  unsharded layer) are in the working margin.
* LoRA (Hu et al. 2021, arXiv:2106.09685): only the adapters get gradients and optimizer state;
  the frozen base is stored in the compute dtype. QLoRA (Dettmers et al. 2023, arXiv:2305.14314):
  the frozen Linear weights of the decoder layers are 4-bit, 0.5 byte per parameter plus the
  quantization constants (one fp32 absmax per 64-weight block, 0.0625 byte per parameter; with
  double quantization an 8-bit absmax per block plus one fp32 constant per 256 blocks, 0.0159);
  `peft.prepare_model_for_kbit_training` upcasts the other parameters (embeddings, head, norms) to
  float32.

Activations: `activations.py` (per decoder layer after Korthikanti et al. 2022, with the device mesh's
splits). The device mesh's per-rank bytes (tensor and context parallelism) and the degree
recommendation: `mesh.py`.
See also `simulate.py` (the meta model sharded by FSDP2 over a fake process group), and
`reference_model.py` for the reference model of preference training (`reference` per rank, in the total).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scaletune.plan.activations import activation_bytes, residual_bytes
from scaletune.plan.entry import GiB, StrategyPlan, assemble
from scaletune.plan.mesh import mesh_entry
from scaletune.plan.reference_model import ReferencePlan, reference_bytes, reference_plan
from scaletune.plan.rollout import RolloutPlan, rollout_plan
from scaletune.plan.shapes import ModelShape, ParamInfo, model_shape
from scaletune.resolve import FLOAT_DTYPES
from scaletune.resolve.mesh import mesh_for
from scaletune.strategies.deepspeed_config import PERSISTENCE_THRESHOLD as DS_PERSISTENCE_THRESHOLD
from scaletune.strategies.deepspeed_config import REDUCE_BUCKET as DS_REDUCE_BUCKET

if TYPE_CHECKING:
    from scaletune.resolve import RunSpec

#: Fastest first: ddp moves 2Ψ per step (all-reduce), ZeRO-1/2 the same volume (reduce-scatter +
#: all-gather), fsdp / ZeRO-3 1.5x (an extra all-gather of the parameters in backward), offload
#: adds PCIe traffic and a CPU optimizer step. fsdp before zero3: native, no extra dependency.
ORDER = ("ddp", "zero1", "zero2", "fsdp", "zero3", "zero2-offload", "fsdp-offload", "zero3-offload")


@dataclass
class Plan:
    strategies: list[StrategyPlan]
    chosen: str
    reason: str
    world_size: int
    gpu_memory_bytes: int | None
    nodes: int = 1
    shape: ModelShape | None = None
    reference: ReferencePlan | None = None
    mesh: StrategyPlan | None = None  # the configured device mesh's entry (`mesh.py`), with degrees > 1
    rollout: RolloutPlan | None = None  # online RL's generation (`rollout.py`), where a stage samples

    def to_json(self) -> dict:
        out = {"strategies": [s.to_json() for s in self.strategies], "chosen": self.chosen, "reason": self.reason}
        out |= {"mesh": self.mesh.to_json()} if self.mesh is not None else {}
        out |= {"rollout": self.rollout.to_json()} if self.rollout is not None else {}
        return out | ({"reference": self.reference.to_json()} if self.reference is not None else {})

    def get(self, name: str) -> StrategyPlan:
        for s in self.strategies:
            if s.name == name:
                return s
        raise KeyError(name)

    def for_run(self, spec: RunSpec) -> StrategyPlan:
        """The entry of the run's strategy (`single` is planned as ddp's replica; a run with tensor or
        context degrees above 1: the mesh's entry)."""
        if spec.mesh.model_parallel and self.mesh is not None:
            return self.mesh
        return self.get(plan_name(spec.strategy, spec.zero_stage, spec.offload_optimizer, spec.offload_params))


def plan_name(strategy: str, zero_stage: int = 2, offload_optimizer: bool = False, offload_params: bool = False) -> str:
    """scaletune's strategy + distributed settings -> the plan's entry name."""
    if strategy in ("single", "ddp"):
        return "ddp"
    if strategy == "fsdp":
        return "fsdp-offload" if offload_params else "fsdp"
    if strategy == "deepspeed":
        if offload_params or offload_optimizer:
            return "zero3-offload" if zero_stage == 3 else "zero2-offload"
        return f"zero{zero_stage}"
    raise ValueError(f"unknown strategy {strategy!r}")


def scaletune_settings(name: str) -> dict:
    return {
        "ddp": {"strategy": "ddp"},
        "zero1": {"strategy": "deepspeed", "zero_stage": 1},
        "zero2": {"strategy": "deepspeed", "zero_stage": 2},
        "zero3": {"strategy": "deepspeed", "zero_stage": 3},
        "fsdp": {"strategy": "fsdp"},
        "zero2-offload": {"strategy": "deepspeed", "zero_stage": 2, "offload_optimizer": True},
        "zero3-offload": {"strategy": "deepspeed", "zero_stage": 3, "offload_optimizer": True, "offload_params": True},
        "fsdp-offload": {"strategy": "fsdp", "offload_params": True},
    }[name]


def _frozen_bytes(shape: ModelShape, spec: RunSpec, b_c: int) -> int:
    """Bytes of the frozen parameters as single/ddp/fsdp store them."""
    q = spec.config.model.quantization
    total = 0
    for p in shape.params:
        if p.trainable:
            continue
        if p.quantized and q is not None and q.bits == 4:
            per = 0.5 + ((1 / 64 + 4 / (64 * 256)) if q.double_quant else 4 / 64)
            total += math.ceil(p.numel * per)
        elif p.quantized and q is not None:  # LLM.int8(): 1 byte + an fp32 scale per row
            total += p.numel + 4 * p.shape[0]
        elif q is not None:
            total += 4 * p.numel  # prepare_model_for_kbit_training upcasts the rest to fp32
        else:
            total += b_c * p.numel
    return total


def _shard(p: ParamInfo, w: int) -> int:
    """Elements of rank 0's FSDP2 shard: dim 0 split in ceil(d0 / W) rows."""
    if not p.shape:
        return 1
    rows = -(-p.shape[0] // w)
    return rows * math.prod(p.shape[1:])


def _strategy_plan(name: str, shape: ModelShape, spec: RunSpec, w: int) -> StrategyPlan:
    b_c = FLOAT_DTYPES[spec.precision.compute][0]
    ds_bytes = b_c  # DeepSpeed casts the whole module to the compute dtype
    trainable = [p for p in shape.params if p.trainable]
    n_t = sum(p.numel for p in trainable)
    n_tensors = len(trainable)
    frozen = _frozen_bytes(shape, spec, b_c)
    offload = name.endswith("-offload")
    base = name.removesuffix("-offload")
    steps = 4 * n_tensors  # AdamW's per-tensor `step` (fp32 scalar)
    margin = 0
    host = 0
    if base == "ddp":
        params = 4 * n_t + frozen
        grads = 4 * n_t
        optimizer = 8 * n_t + steps
        if spec.config.model.mixed_precision == "bf16_params" and b_c < 4 and not frozen:
            root = sum(p.numel for p in shape.params if not p.in_layer)
            layer = max((sum(p.numel for p in shape.params if p.in_layer) // max(shape.layers, 1)), 1)
            margin = b_c * root + layer * (2 * b_c + b_c + 4)  # root + 2 layers copies, a layer's bf16 + fp32 grads
    elif base == "fsdp":
        shard_t = sum(_shard(p, w) for p in trainable)
        params = 4 * shard_t + sum(
            math.ceil(_frozen_bytes(ModelShape([p], 0, 0, 0, 1, 1, 1, 0), spec, b_c) * _shard(p, w) / max(p.numel, 1))
            for p in shape.params
            if not p.trainable
        )
        grads = 4 * shard_t
        optimizer = 8 * shard_t + steps
        # One unsharded decoder layer (plus the next one prefetched) in the compute dtype, and its
        # gradient before the reduce-scatter.
        layer = max((sum(p.numel for p in shape.params if p.in_layer) // max(shape.layers, 1)), 1)
        margin = layer * (2 * b_c + 4)
        if offload:
            host = params + grads + optimizer
            params = grads = optimizer = 0
    else:  # DeepSpeed ZeRO
        stage = int(base[-1]) if base.startswith("zero") else 2
        part = -(-n_t // (2 * w)) * 2  # flat buffer aligned to 2 x W elements
        master = 4 * part
        moments = 8 * part
        if stage <= 2:
            params = ds_bytes * shape.total
            grads = 4 * part
            if stage == 2:
                margin = ds_bytes * min(DS_REDUCE_BUCKET, n_t) + ds_bytes * part  # ipg bucket, grads_in_partition
            else:
                margin = ds_bytes * n_t  # full-size gradients until the reduce at the step
        else:
            own = sum(-(-p.numel // w) for p in shape.params)
            persistent = sum(p.numel for p in shape.params if p.numel < DS_PERSISTENCE_THRESHOLD)
            params = ds_bytes * (own + persistent)
            grads = 4 * part + ds_bytes * sum(-(-p.numel // w) for p in trainable)
            layer = max((sum(p.numel for p in shape.params if p.in_layer) // max(shape.layers, 1)), 1)
            margin = ds_bytes * DS_REDUCE_BUCKET + 2 * layer * ds_bytes
        if stage == 3 and ds_bytes == 4 and not offload:
            master = 0  # fp32 module: ZeRO-3 steps on its own flat partition, no second copy
        groups = len({len(p.shape) >= 2 for p in trainable})  # AdamW decay / no-decay groups
        optimizer = master + moments + 4 * groups  # one flat tensor (one `step`) per group
        if offload:
            host = optimizer + 4 * part
            optimizer = 0
            grads = 0
            if stage == 3:
                host += params
                layer = max((sum(p.numel for p in shape.params if p.in_layer) // max(shape.layers, 1)), 1)
                params = ds_bytes * sum(p.numel for p in shape.params if p.numel < DS_PERSISTENCE_THRESHOLD)
                margin = ds_bytes * DS_REDUCE_BUCKET + 2 * layer * ds_bytes
    r = residual_bytes(spec, name)
    act_ckpt = activation_bytes(shape, spec, checkpointing=True, residual=r)
    act_full = activation_bytes(shape, spec, checkpointing=False, residual=r)
    return assemble(
        name,
        spec,
        params=params,
        grads=grads,
        optimizer=optimizer,
        act_ckpt=act_ckpt,
        act_full=act_full,
        margin=margin,
        scaletune=scaletune_settings(name),
        host_bytes=host,
    )


def deepspeed_available() -> bool:
    """DeepSpeed is importable here (ZeRO strategies are candidates only then)."""
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def plan(
    spec: RunSpec,
    *,
    world_size: int | None = None,
    gpu_memory_bytes: int | None = None,
    nodes: int = 1,
    shape: ModelShape | None = None,
) -> Plan:
    """Bytes per rank of every strategy for the run, and the choice.

    Args:
        world_size: ranks in the job (all nodes); default the run's.
        gpu_memory_bytes: memory of one device; None: nothing is said to fit or not, ddp is chosen.
        nodes: nodes in the job (reported; the per-rank arithmetic does not depend on it).
        shape: a :func:`model_shape` already counted (saves building the meta model again).

    Returns:
        The :class:`Plan`: the fastest strategy that fits (:data:`ORDER`); at world size 1 `ddp`
        means `single`, and only it and the offload variants are candidates. With tensor or context
        degrees above 1 in the config, `mesh` is that mesh's fsdp entry (`mesh.py`; with pipeline
        stages, the first stage's rank 0).
    """
    w = world_size or spec.world_size
    shape = shape or model_shape(spec)
    out = [_strategy_plan(n, shape, spec, w) for n in ORDER]
    ref = reference_plan(spec)
    rollout = rollout_plan(spec, shape)
    for s in out:
        device, host = reference_bytes(s.name, shape, spec, w, ref)
        s.reference, s.host_bytes, s.margin = device, s.host_bytes + host, s.margin + device // 10
        s.kv_cache = rollout.kv_cache if rollout is not None else 0
        s.fits = None if gpu_memory_bytes is None else s.total <= gpu_memory_bytes
    # A quantized base cannot be sharded by FSDP (resolve/rules.py), so it is never chosen for one.
    quantized = spec.config.model.quantization is not None
    chosen, reason = _choose([s for s in out if not (quantized and s.name.startswith("fsdp"))], w, gpu_memory_bytes)
    mesh = mesh_for(spec.config.distributed, w)
    on_mesh = mesh_entry(spec, shape, mesh, gpu_memory_bytes=gpu_memory_bytes) if mesh.model_parallel else None
    return Plan(out, chosen, reason, w, gpu_memory_bytes, nodes, shape, ref, on_mesh, rollout)


def _choose(out: list[StrategyPlan], w: int, mem: int | None) -> tuple[str, str]:
    ddp = out[0]
    if mem is None:
        return "ddp", "no device memory given, so the plan keeps data parallelism (ddp), the fastest"
    candidates = [s for s in out if (deepspeed_available() or not s.name.startswith("zero"))]
    if w == 1:
        candidates = [s for s in candidates if s.name == "ddp" or s.name.endswith("-offload")]
    fitting = [s for s in candidates if s.fits]
    gib = mem / GiB
    if not fitting:
        best = min(candidates, key=lambda s: s.total)
        return best.name, (
            f"nothing fits in {gib:.0f} GiB per device; {best.name} needs the least "
            f"({best.total / GiB:.1f} GiB): add devices, use LoRA/QLoRA, gradient checkpointing or a smaller micro_batch_size"
        )
    pick = fitting[0]
    if pick.name == "ddp":
        return "ddp", (
            f"ddp fits ({pick.total / GiB:.1f} of {gib:.0f} GiB per device) and is the fastest: "
            "a full replica per rank, one all-reduce of the gradients per step"
        )
    return pick.name, (
        f"ddp needs {ddp.total / GiB:.1f} GiB per device, more than {gib:.0f} GiB; {pick.name} is the fastest "
        f"that fits ({pick.total / GiB:.1f} GiB)"
    )
