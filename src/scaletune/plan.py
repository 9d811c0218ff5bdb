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
  autocast (single, ddp) or FSDP2's `MixedPrecisionPolicy` (fsdp): parameters 4 bytes, gradients
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

Activations per decoder layer follow Korthikanti et al. 2022 (arXiv:2205.05198, section 4.1:
`sbh(34 + 5as/h)` bytes for a GPT layer with 16-bit activations), adapted to the architectures
scaletune trains: no dropout (no masks), RMSNorm (its input kept: 2 norms x sbh), grouped-query
attention (K and V are `h_kv = n_kv x head_dim` wide), fused attention (SDPA / flash: the output
and a fp32 logsumexp per head, no s^2 terms; `eager` keeps the 2-byte a s^2 b softmax), and a
SwiGLU MLP of width i (input, gate, SiLU(gate), up, product: sbh + 4 sbi). In elements:
`sbh (6 + 2 h_kv / h) + 4 sbi` per layer, times the activation width (2 bytes bf16/fp16, 4 fp32).
LoRA adds each adapter's `x A` (s b r) and, with `lora.dropout > 0`, the dropped-out input and its
1-byte mask per target module. With gradient checkpointing (non-reentrant, per decoder layer) a
layer keeps only its input (sbh) and one layer is recomputed at a time: `L sbh + one layer`.
The loss (`loss.py`) never builds `[tokens, vocab]` logits: one chunk of 1024 target rows is
alive, in the compute dtype, as fp32, its log-softmax and its gradient (`1024 V (b_c + 12)`).

Scale by simulation: :func:`simulate_fsdp` shards the meta model with FSDP2's `fully_shard`
over PyTorch's fake process group of W ranks in this one process and reports rank 0's shards.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scaletune.config import Config, DistributedConfig

if TYPE_CHECKING:
    import torch

    from scaletune.env import DistributedEnv

GiB = 1024**3

#: Fastest first: ddp moves 2Ψ per step (all-reduce), ZeRO-1/2 the same volume (reduce-scatter +
#: all-gather), fsdp / ZeRO-3 1.5x (an extra all-gather of the parameters in backward), offload
#: adds PCIe traffic and a CPU optimizer step. fsdp before zero3: native, no extra dependency.
ORDER = ("ddp", "zero1", "zero2", "fsdp", "zero3", "zero2-offload", "fsdp-offload", "zero3-offload")

#: DeepSpeed settings scaletune writes (strategies/deepspeed.py).
DS_REDUCE_BUCKET = int(5e8)
DS_PERSISTENCE_THRESHOLD = int(1e5)
LOSS_CHUNK = 1024

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---------------------------------------------------------------------------------------------
# Counting the model


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor of the meta model."""

    name: str
    shape: tuple[int, ...]
    trainable: bool
    quantized: bool  # a frozen Linear weight of a decoder layer stored 4-bit under QLoRA
    in_layer: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ModelShape:
    """What the planner needs to know about the model: every parameter tensor and the dimensions
    the activation estimate uses."""

    params: list[ParamInfo]
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    lora_modules: list[tuple[int, int]] = field(default_factory=list)  # (in_features, r) per target module per layer
    model_type: str = ""

    @property
    def total(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def trainable(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    @property
    def frozen(self) -> int:
        return self.total - self.trainable


def _meta_model(cfg: Config, *, storage: str | None = None) -> torch.nn.Module:
    """The model of `cfg` on the meta device in scaletune's storage dtypes, with LoRA if asked."""
    import torch

    from scaletune.models import DevicePlacement, apply_lora, load_model

    model_cfg = cfg.model
    if storage is not None:
        model_cfg = model_cfg.model_copy(update={"dtype": storage})
    model = load_model(model_cfg.model_copy(update={"quantization": None}), DevicePlacement(None, "cpu"), meta=True)
    if cfg.model.lora is not None:
        with torch.device("meta"):
            model = apply_lora(model, cfg.model.lora)
    return model


def _storage_dtype(cfg: Config) -> str:
    """Trainable weights are fp32 master weights; a frozen LoRA base is in the compute dtype."""
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else "bfloat16"
    return dtype if cfg.model.lora is not None else "float32"


def model_shape(cfg: Config) -> ModelShape:
    """Count the parameters of `cfg`'s model exactly, from its config on the meta device."""
    from torch import nn

    from scaletune.models import _unwrap, decoder_layer_classes, load_config

    hf_cfg = load_config(cfg.model)
    model = _meta_model(cfg, storage=_storage_dtype(cfg))
    layer_types = tuple(decoder_layer_classes(model))
    layer_prefixes = [n for n, m in model.named_modules() if isinstance(m, layer_types)]
    linear_weights = {f"{n}.weight" for n, m in model.named_modules() if type(m) is nn.Linear}
    quant = cfg.model.quantization is not None
    params, seen = [], set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # tied embeddings: one tensor
            continue
        seen.add(id(p))
        in_layer = any(name.startswith(pre + ".") for pre in layer_prefixes)
        is_lora = "lora_" in name
        params.append(
            ParamInfo(
                name=name,
                shape=tuple(p.shape),
                trainable=bool(p.requires_grad),
                quantized=quant and in_layer and not is_lora and not p.requires_grad and name in linear_weights,
                in_layer=in_layer,
            )
        )
    lora_modules: list[tuple[int, int]] = []
    if cfg.model.lora is not None and layer_prefixes:
        first = layer_prefixes[0]
        for n, m in model.named_modules():
            if n.startswith(first + ".") and n.endswith("lora_A.default"):
                lora_modules.append((m.in_features, m.out_features))
    text = getattr(hf_cfg, "text_config", None) or hf_cfg
    hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0))
    heads = int(getattr(text, "num_attention_heads", 1))
    head_dim = int(getattr(text, "head_dim", None) or hidden // max(heads, 1))
    base = _unwrap(model)
    return ModelShape(
        params=params,
        hidden=hidden,
        intermediate=int(getattr(text, "intermediate_size", None) or 4 * hidden),
        layers=len(layer_prefixes) or int(getattr(text, "num_hidden_layers", 1)),
        heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        vocab=int(base.get_output_embeddings().weight.shape[0]),
        lora_modules=lora_modules,
        model_type=str(getattr(text, "model_type", "")),
    )


# ---------------------------------------------------------------------------------------------
# Per-strategy accounting


@dataclass
class StrategyPlan:
    """One strategy's bytes per rank (rank 0, which holds the largest shard).

    `per_rank_bytes` = device memory: params, grads, optimizer (with DeepSpeed's fp32 master
    partition), activations (as configured: with or without checkpointing), total (the four plus
    `margin`). Offloaded state is in `host_bytes` instead.
    """

    name: str
    params: int
    grads: int
    optimizer: int
    activations: int
    margin: int
    fits: bool | None
    activations_no_ckpt: int = 0
    activations_ckpt: int = 0
    host_bytes: int = 0
    scaletune: dict = field(default_factory=dict)  # {"strategy": ..., zero_stage / offload overrides}

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.margin

    @property
    def per_rank_bytes(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "total": self.total,
        }

    def to_json(self) -> dict:
        return {"name": self.name, "per_rank_bytes": self.per_rank_bytes, "fits": self.fits}


@dataclass
class Plan:
    strategies: list[StrategyPlan]
    chosen: str
    reason: str
    world_size: int
    gpu_memory_bytes: int | None
    nodes: int = 1
    shape: ModelShape | None = None

    def to_json(self) -> dict:
        return {"strategies": [s.to_json() for s in self.strategies], "chosen": self.chosen, "reason": self.reason}

    def get(self, name: str) -> StrategyPlan:
        for s in self.strategies:
            if s.name == name:
                return s
        raise KeyError(name)

    def for_strategy(self, strategy_name: str, dist_cfg: DistributedConfig) -> StrategyPlan:
        """The entry for scaletune's (strategy, zero_stage, offload flags); `single` is ddp's."""
        return self.get(plan_name(strategy_name, dist_cfg))


def plan_name(strategy_name: str, dist_cfg: DistributedConfig) -> str:
    """scaletune's strategy + distributed flags -> the plan's entry name."""
    if strategy_name in ("single", "ddp", "auto"):
        return "ddp"
    if strategy_name == "fsdp":
        return "fsdp-offload" if dist_cfg.offload_params else "fsdp"
    if strategy_name == "deepspeed":
        stage = dist_cfg.zero_stage
        if dist_cfg.offload_params or dist_cfg.offload_optimizer:
            return "zero3-offload" if stage == 3 else "zero2-offload"
        return f"zero{stage}"
    raise ValueError(f"unknown strategy {strategy_name!r}")


def _scaletune_settings(name: str) -> dict:
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


def _compute_bytes(cfg: Config, cuda: bool = True) -> int:
    dtype = cfg.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if cuda else "float32"
    return _BYTES[dtype]


def _frozen_bytes(shape: ModelShape, cfg: Config, b_c: int) -> int:
    """Bytes of the frozen parameters as single/ddp/fsdp store them."""
    q = cfg.model.quantization
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


def activation_bytes(shape: ModelShape, cfg: Config, *, checkpointing: bool, cuda: bool = True) -> int:
    """Activation bytes of one micro-batch on one rank (see the module docstring)."""
    s, b = cfg.data.max_seq_length, cfg.training.micro_batch_size
    h, i, L = shape.hidden, shape.intermediate, shape.layers
    p = _compute_bytes(cfg, cuda)
    h_kv = shape.kv_heads * shape.head_dim
    q_width = shape.heads * shape.head_dim
    per_layer = s * b * p * (4 * h + 2 * q_width + 2 * h_kv + 4 * i)  # 2 norm inputs + 2 norm outputs
    if (cfg.model.attn_implementation or "sdpa") == "eager":
        per_layer += 2 * shape.heads * s * s * b * p  # scores (softmax output) and the attention over V
    else:
        per_layer += 4 * shape.heads * s * b  # logsumexp per head, fp32
    lora = cfg.model.lora
    if lora is not None:
        for d_in, r in shape.lora_modules:
            per_layer += s * b * r * p
            if lora.dropout > 0:
                per_layer += s * b * d_in * (p + 1)
    loss = min(LOSS_CHUNK, s * b) * shape.vocab * (p + 12)
    edges = s * b * h * p * 2  # embedding output, final norm input/output at the targets
    if checkpointing:
        return L * s * b * h * p + per_layer + loss + edges
    return L * per_layer + loss + edges


def _strategy_plan(name: str, shape: ModelShape, cfg: Config, w: int, cuda: bool) -> StrategyPlan:
    b_c = _compute_bytes(cfg, cuda)
    ds_bytes = b_c  # DeepSpeed casts the whole module to the compute dtype
    trainable = [p for p in shape.params if p.trainable]
    n_t = sum(p.numel for p in trainable)
    n_tensors = len(trainable)
    frozen = _frozen_bytes(shape, cfg, b_c)
    offload = name.endswith("-offload")
    base = name.removesuffix("-offload")
    steps = 4 * n_tensors  # AdamW's per-tensor `step` (fp32 scalar)
    margin = 0
    host = 0
    if base == "ddp":
        params = 4 * n_t + frozen
        grads = 4 * n_t
        optimizer = 8 * n_t + steps
    elif base == "fsdp":
        shard_t = sum(_shard(p, w) for p in trainable)
        params = 4 * shard_t + sum(
            math.ceil(_frozen_bytes(ModelShape([p], 0, 0, 0, 1, 1, 1, 0), cfg, b_c) * _shard(p, w) / max(p.numel, 1))
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
    act_ckpt = activation_bytes(shape, cfg, checkpointing=True, cuda=cuda)
    act_full = activation_bytes(shape, cfg, checkpointing=False, cuda=cuda)
    act = act_ckpt if cfg.model.gradient_checkpointing else act_full
    # Allocator fragmentation and temporaries: 10% of the rest.
    margin += (params + grads + optimizer + act) // 10
    return StrategyPlan(
        name=name, params=params, grads=grads, optimizer=optimizer, activations=act, margin=margin,
        fits=None, activations_no_ckpt=act_full, activations_ckpt=act_ckpt, host_bytes=host,
        scaletune=_scaletune_settings(name),
    )  # fmt: skip


def _deepspeed_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def plan(
    cfg: Config,
    *,
    world_size: int,
    gpu_memory_bytes: int | None,
    nodes: int = 1,
    shape: ModelShape | None = None,
    cuda: bool = True,
) -> Plan:
    """Bytes per rank of every strategy for `cfg` on `world_size` ranks, and the choice.

    Args:
        world_size: ranks in the job (all nodes).
        gpu_memory_bytes: memory of one device; None: nothing is said to fit or not, ddp is chosen.
        nodes: nodes in the job (reported; the per-rank arithmetic does not depend on it).
        shape: a :func:`model_shape` already counted (saves building the meta model again).
        cuda: the job computes on GPUs (`model.dtype: auto` means bf16 there, fp32 on CPU).

    Returns:
        The :class:`Plan`: the fastest strategy that fits (:data:`ORDER`); at world size 1 `ddp`
        means `single`, and only it and the offload variants are candidates.
    """
    shape = shape or model_shape(cfg)
    out = [_strategy_plan(n, shape, cfg, world_size, cuda) for n in ORDER]
    for s in out:
        s.fits = None if gpu_memory_bytes is None else s.total <= gpu_memory_bytes
    chosen, reason = _choose(out, cfg, world_size, gpu_memory_bytes)
    return Plan(out, chosen, reason, world_size, gpu_memory_bytes, nodes, shape)


def _choose(out: list[StrategyPlan], cfg: Config, w: int, mem: int | None) -> tuple[str, str]:
    ddp = out[0]
    if mem is None:
        return "ddp", "no device memory given, so the plan keeps data parallelism (ddp), the fastest"
    ds = _deepspeed_available()
    candidates = [s for s in out if (ds or not s.name.startswith("zero"))]
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


def choose_auto_strategy(cfg: Config, env: DistributedEnv, *, gpu_memory_bytes: int | None = None) -> tuple[str, dict]:
    """scaletune's strategy for `distributed.strategy: auto` and the distributed overrides.

    On a GPU machine the plan decides with the memory of this rank's device; on the CPU (or when
    the model's config cannot be read) `single` at world size 1 and `ddp` above, as before,
    unless `gpu_memory_bytes` is given and ddp does not fit in it.

    Returns:
        (strategy, overrides) such as ("ddp", {}) or ("deepspeed", {"zero_stage": 3}); apply the
        overrides to `cfg.distributed` (`model_copy(update=...)`).
    """
    default = "ddp" if env.world_size > 1 else "single"
    mem = gpu_memory_bytes
    if mem is None and env.cuda_available:
        import torch

        mem = torch.cuda.get_device_properties(env.local_rank % max(1, env.cuda_device_count)).total_memory
    if mem is None:
        return default, {}
    p = plan(cfg, world_size=env.world_size, gpu_memory_bytes=mem, cuda=env.cuda_available)
    if p.chosen == "ddp":
        return default, {}
    settings = dict(_scaletune_settings(p.chosen))
    name = settings.pop("strategy")
    return name, settings


# ---------------------------------------------------------------------------------------------
# Measuring what a rank holds


def _storage_key(t: Any) -> tuple | None:
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if t.device.type == "meta" or st.nbytes() == 0:
        return None
    return (t.device.type, t.device.index, st.data_ptr())


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _count(tensors: Any, seen: dict) -> int:
    """Bytes of the storages behind `tensors` not yet in `seen` (each storage once)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        key = _storage_key(t)
        if key is None or key in seen:
            continue
        seen[key] = True
        total += t.untyped_storage().nbytes()
    return total


def _module_params(strategy: Any) -> list:
    mod = strategy.module if getattr(strategy, "module", None) is not None else strategy.model
    return list(mod.parameters())


def _zero_optimizer(strategy: Any) -> Any:
    engine = getattr(strategy, "engine", None)
    return getattr(engine, "optimizer", None) if engine is not None else None


def _grad_tensors(strategy: Any) -> list:
    """The gradient tensors this rank holds now: `.grad` of the module's and the optimizer's
    parameters, and DeepSpeed's persistent partitioned gradient buffers."""
    out = [p.grad for p in _module_params(strategy)]
    opt = getattr(strategy, "optimizer", None)
    if opt is not None:
        out += [p.grad for g in opt.param_groups for p in g["params"]]
    zero = _zero_optimizer(strategy)
    if zero is not None:
        out.append(getattr(zero, "grad_partitions_flat_buffer", None))  # ZeRO-3
    return out


def track_gradients(strategy: Any) -> None:
    """Record the gradient bytes this rank holds when its optimizer steps (a step pre-hook), for
    :func:`measure_memory`: engines free gradients right after the step. Call once after `wrap`."""
    opt = strategy.optimizer
    if getattr(strategy, "_grad_hook", None) is not None or opt is None:
        return

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        if getattr(strategy, "_grad_bytes", None) is None:
            strategy._grad_bytes = _count(_grad_tensors(strategy), {})

    strategy._grad_bytes = None
    strategy._grad_hook = opt.register_step_pre_hook(hook)


def measure_memory(strategy: Any) -> dict:
    """Bytes of the tensors this rank holds, from the real objects, for memory.json.

    * params: storages of the module's parameters (a DTensor's local shard; DeepSpeed ZeRO-3's
      partition `ds_tensor`, and whole tensors it keeps persistent; ZeRO-1/2's flat buffer).
    * grads: the gradients at the optimizer step, recorded by :func:`track_gradients` (installed
      here if it was not, in which case the gradients present now are counted).
    * optimizer: the optimizer's state tensors and its parameters that are not the module's
      (DeepSpeed's fp32 master partitions).
    * peak_device: `torch.cuda.max_memory_allocated()` on CUDA, else None.

    Each storage is counted once (views into one flat buffer count the buffer).
    """
    import torch

    seen: dict = {}
    params = _module_params(strategy)
    tensors = list(params) + [getattr(p, "ds_tensor", None) for p in params]
    p_bytes = _count(tensors, seen)
    opt = getattr(strategy, "optimizer", None)
    o_bytes = 0
    if opt is not None:
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        masters = [p for g in opt.param_groups for p in g["params"]]
        o_bytes = _count(state + masters, seen)
    grads = getattr(strategy, "_grad_bytes", None)
    if grads is None:
        grads = _count(_grad_tensors(strategy), dict(seen))
    env = getattr(strategy, "env", None)
    peak = None
    if torch.cuda.is_available() and env is not None and getattr(env, "cuda_available", False):
        peak = int(torch.cuda.max_memory_allocated())
    return {"rank": int(getattr(env, "rank", 0)), "params": int(p_bytes), "grads": int(grads), "optimizer": int(o_bytes), "peak_device": peak}


# ---------------------------------------------------------------------------------------------
# Fake-world simulation


def simulate_fsdp(cfg: Config, world_size: int) -> dict:
    """Shard the meta model with FSDP2 over a fake process group of `world_size` ranks, in this
    process, and report rank 0's shard bytes (parameters as scaletune stores them).

    Returns:
        {"world_size", "params_bytes" (rank 0's local shards), "full_bytes", "tensors", "seconds"}.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from scaletune.models import decoder_layer_classes

    t0 = time.perf_counter()
    if dist.is_initialized():
        raise RuntimeError("simulate_fsdp needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        model = _meta_model(cfg, storage=_storage_dtype(cfg))
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        mesh = init_device_mesh("cpu", (world_size,))
        layer_types = tuple(decoder_layer_classes(model))
        for m in [m for m in model.modules() if isinstance(m, layer_types)]:
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        local = [p.to_local() for p in model.parameters()]
        shard = sum(t.numel() * t.element_size() for t in local)
        return {
            "world_size": world_size,
            "params_bytes": int(shard),
            "full_bytes": int(full),
            "tensors": len(local),
            "seconds": round(time.perf_counter() - t0, 2),
        }
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Presentation


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def render_table(p: Plan) -> Any:
    """A rich Table of the plan (GiB per rank)."""
    from rich.table import Table

    mem = f"{p.gpu_memory_bytes / GiB:.0f} GiB" if p.gpu_memory_bytes else "unknown memory"
    t = Table(title=f"memory per rank, world size {p.world_size} ({p.nodes} node(s)), {mem} per device; GiB")
    for col in ("strategy", "params", "grads", "optimizer", "activations", "act. no ckpt", "act. ckpt", "margin", "total", "host", "fits"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for s in p.strategies:
        fits = "-" if s.fits is None else ("yes" if s.fits else "no")
        mark = " *" if s.name == p.chosen else ""
        t.add_row(
            s.name + mark, _gib(s.params), _gib(s.grads), _gib(s.optimizer), _gib(s.activations),
            _gib(s.activations_no_ckpt), _gib(s.activations_ckpt), _gib(s.margin), _gib(s.total),
            _gib(s.host_bytes), fits,
        )  # fmt: skip
    return t


def describe_shape(shape: ModelShape) -> str:
    return (
        f"{shape.model_type or 'model'}: {shape.total:,} parameters ({shape.trainable:,} trainable), "
        f"{shape.layers} layers x {shape.hidden} hidden, {shape.heads} heads ({shape.kv_heads} kv), "
        f"MLP {shape.intermediate}, vocab {shape.vocab}"
    )


def cli_plan(cfg: Config, *, gpus: int | None, gpu_memory_gib: float | None, nodes: int = 1) -> tuple[Plan, str]:
    """`scaletune plan`: the world size and device memory from the options or this machine.

    `--gpus` is per node (world size = gpus x nodes). Without it, the GPUs torch sees; on a
    machine without GPUs, one process and the machine's RAM as its "device" memory (a CPU run),
    unless `--gpu-memory` is given. `--gpu-memory` defaults to the first visible GPU's memory.

    Returns:
        (plan, a note saying where the numbers came from).
    """
    import torch

    cuda = torch.cuda.is_available()
    notes = []
    if gpus is None:
        if cuda:
            gpus = torch.cuda.device_count()
            notes.append(f"{gpus} visible GPU(s) per node")
        else:
            gpus = 1
            notes.append("no GPU visible: planning one CPU process (pass --gpus N --gpu-memory GIB to plan for GPUs)")
    else:
        cuda = True if gpus > 0 else cuda
        gpus = max(gpus, 1)
    if gpu_memory_gib is not None:
        mem = int(gpu_memory_gib * GiB)
    elif torch.cuda.is_available():
        mem = int(torch.cuda.get_device_properties(0).total_memory)
        notes.append(f"{mem / GiB:.0f} GiB per GPU ({torch.cuda.get_device_name(0)})")
    elif not cuda:
        import os

        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        notes.append(f"{mem / GiB:.0f} GiB of RAM")
    else:
        mem = None
        notes.append("device memory unknown: pass --gpu-memory GIB to know what fits")
    p = plan(cfg, world_size=gpus * nodes, gpu_memory_bytes=mem, nodes=nodes, cuda=cuda)
    return p, "; ".join(notes)
