"""Bytes per rank on a device mesh `(pipeline, data_shard, context, tensor)` and the recommended
degrees for a sequence length.

What one rank holds under `strategy: fsdp` with tensor degree t, context degree c and data degree
d (FSDP2 shards over the flattened `data_shard x context` group of `dc = d x c` ranks,
`strategies/parallel/mesh.py`, torchtitan's `dp_shard_cp`):

* Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053, section 3; by DTensor,
  `strategies/parallel/tensor.py`, from the model's `base_model_tp_plan`, :class:`TensorLayout`): a
  column-wise projection (`colwise*` styles: Llama's q/k/v/gate/up) keeps the weight's `Shard(0)`,
  `[out / t, in]`, and its bias `[out / t]`; a row-wise one (`rowwise*`: o/down) keeps `Shard(1)`,
  `[out, in / t]`, and a whole bias; the output head `[V / t, h]` (vocab-parallel); a tied head and
  its embeddings are that one `[V / t, h]` tensor. Everything else (untied embeddings, norms) is
  whole on every tensor rank. LoRA adapters
  follow their target: a column-wise target's `lora_B` `[out / t, r]` and whole `lora_A`; a row-wise
  target's `lora_A` `[r, in / t]` and whole `lora_B`. Rank 0 of an uneven split holds
  `ceil(n / t)`, as `torch.chunk` (DTensor's `Shard`) gives it.
* FSDP2 (`fully_shard` on the `dc` group) then chunks each LOCAL tensor on dim 0
  (`_chunk_with_empty` in `torch/distributed/fsdp/_fully_shard/_fsdp_param.py`): every rank's
  storage is padded to the first chunk, `ceil(d0_local / dc) x prod(rest)` elements.
* Bytes per element as the fsdp entry counts them (`estimates.py`): a trainable parameter 4 (fp32
  master), its gradient 4, AdamW's two moments 8, plus one 4-byte `step` per trainable tensor; a
  frozen one (LoRA's base) the compute dtype. Quantization, offload and preference objectives are
  refused with a mesh (`resolve/mesh.py`), so they do not appear here.
* Activations: `activations.py` with `tensor=t, context=c` (Korthikanti et al. 2022 section 4.2
  without sequence parallelism; DeepSpeed-Ulysses for the context split).
* Working margin: one unsharded decoder layer (its tensor-local part) in the compute dtype with its
  prefetched neighbour and fp32 gradient, as the fsdp entry, plus 10% of the rest.

The recommendation (:func:`recommend_mesh`) walks tensor degrees from 1 up (within a node), and for
each the context degrees from 1 up, and names the first mesh whose rank fits the device: the
smallest context degree that fits at the smallest tensor degree that allows one. Context before
tensor: DeepSpeed-Ulysses moves `4 s b h / c` elements per layer in all-to-alls (Jacobs et al.
2023, section 3.1), tensor parallelism all-reduces `4 s b h` per layer (Korthikanti et al. 2022,
section 4.2) and leaves the residual stream's activations whole on every rank.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scaletune.plan.activations import activation_bytes
from scaletune.plan.entry import GiB, StrategyPlan, assemble
from scaletune.plan.shapes import ModelShape, ParamInfo
from scaletune.resolve import FLOAT_DTYPES, Mesh

if TYPE_CHECKING:
    from scaletune.resolve import RunSpec


def _ceil(n: int, k: int) -> int:
    return -(-n // k)


@dataclass(frozen=True)
class TensorLayout:
    """How `strategies/parallel/tensor.py` splits a model: its config's `base_model_tp_plan`
    (module-name pattern -> transformers style name) and whether the head is tied to the embeddings
    (then both are the one vocab-parallel tensor)."""

    plan: dict[str, str]
    tied: bool = False

    @classmethod
    def of(cls, hf_config: Any) -> TensorLayout:
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        plan = dict(getattr(text, "base_model_tp_plan", None) or getattr(hf_config, "base_model_tp_plan", None) or {})
        return cls(plan, bool(getattr(hf_config, "tie_word_embeddings", False)))

    def style(self, module_path: str) -> str | None:
        """The style of a module (its dotted name in the CausalLM or peft model), matched as the
        strategy matches the plan's keys, on the name's last parts."""
        from scaletune.strategies.parallel.tensor import matches_plan_key

        parts = module_path.split(".")
        for pattern, style in self.plan.items():
            n = len(pattern.split("."))
            if len(parts) >= n and matches_plan_key(".".join(parts[-n:]), pattern):
                return style
        return None

    @property
    def splits_heads(self) -> bool:
        """The attention's heads are split over the tensor ranks (plain `colwise` q/k/v); the
        `colwise_gather_output` styles (OLMo-2's q/k/v, for its norms over all heads) gather them
        back, so every tensor rank runs attention on all heads."""
        q = [style for pattern, style in self.plan.items() if pattern.endswith("q_proj")]
        return bool(q) and q[0] == "colwise"


def _role(name: str) -> tuple[str, str]:
    """(module path, part) of a parameter name: the Linear's own path (peft's `base_layer` and
    `lora_A.default` wrappers looked through) and `weight`, `bias`, `lora_A` or `lora_B`."""
    parts = name.split(".")
    for adapter in ("lora_A", "lora_B"):
        if adapter in parts:
            i = parts.index(adapter)
            return (".".join(parts[:i]), adapter)
    if "base_layer" in parts:
        i = parts.index("base_layer")
        return (".".join(parts[:i]), parts[-1])
    return (".".join(parts[:-1]), parts[-1])


#: The output head's module names (`get_output_embeddings()` of the architectures with a plan).
HEADS = frozenset({"lm_head", "embed_out"})


def tensor_local_shape(name: str, shape: tuple[int, ...], tensor: int, layout: TensorLayout) -> tuple[int, ...]:
    """The shape rank 0 of a tensor group holds of parameter `name` (see the module docstring).

    Args:
        name: the parameter's name in the (peft-wrapped) model, e.g. `model.layers.0.self_attn.q_proj.weight`.
        shape: its full shape.
        tensor: the tensor-parallel degree.
        layout: the model's :class:`TensorLayout`.
    """
    if tensor == 1 or not shape:
        return shape
    module, part = _role(name)
    leaf = module.rsplit(".", 1)[-1]
    style = layout.style(module)
    dim = None
    if leaf in HEADS or (layout.tied and len(shape) == 2 and not style and "embed" in leaf):
        dim = 0  # the vocab-parallel head (and, tied, the embedding it shares)
    elif style is not None and style.startswith("colwise"):
        dim = 0 if part in ("weight", "bias", "lora_B") else None
    elif style is not None and style.startswith("rowwise"):
        dim = 1 if part in ("weight", "lora_A") else None
    if dim is None or dim >= len(shape):
        return shape
    return shape[:dim] + (_ceil(shape[dim], tensor),) + shape[dim + 1 :]


def mesh_shard_elements(p: ParamInfo, mesh: Mesh, layout: TensorLayout) -> int:
    """Elements of rank 0's storage of `p`: its tensor-local shape chunked by FSDP2 on dim 0 over
    the `data_shard x context` ranks (padded to the first chunk)."""
    local = tensor_local_shape(p.name, p.shape, mesh.tensor, layout)
    if not local:
        return 1
    return _ceil(local[0], mesh.data_shard * mesh.context) * math.prod(local[1:])


def mesh_name(mesh: Mesh) -> str:
    pipeline = f"pp{mesh.pipeline} " if mesh.pipeline > 1 else ""
    return f"fsdp {pipeline}dp{mesh.data_shard} cp{mesh.context} tp{mesh.tensor}"


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def first_stage(shape: ModelShape, pipeline: int) -> list[ParamInfo]:
    """The parameter tensors rank 0 holds with `pipeline` stages: the first stage's layers
    (`strategies.parallel.pipeline.stage_layers`) and the input embeddings; the final norm and the
    head are the last stage's. All of them without a pipeline."""
    if pipeline == 1:
        return list(shape.params)
    from scaletune.strategies.parallel.pipeline import stage_layers

    layers = stage_layers(shape.layers, 0, pipeline)
    out = []
    for p in shape.params:
        m = _LAYER.search(p.name)
        if (m is not None and int(m.group(1)) in layers) or (m is None and "embed_tokens" in p.name):
            out.append(p)
    return out


def run_layout(spec: RunSpec) -> TensorLayout:
    """The run's model's :class:`TensorLayout` (its config read as `models.load_config` reads it:
    presets and local folders offline); an empty one for a factory's module."""
    from scaletune.models import load_config

    return TensorLayout({}) if spec.custom_model else TensorLayout.of(load_config(spec.config.model))


def mesh_entry(
    spec: RunSpec,
    shape: ModelShape,
    mesh: Mesh,
    *,
    seq_len: int | None = None,
    gpu_memory_bytes: int | None = None,
    layout: TensorLayout | None = None,
) -> StrategyPlan:
    """Bytes one rank holds under `strategy: fsdp` on `mesh` (see the module docstring): the plan
    entry a run on that mesh measures in `memory.json` (`params`, `grads`, `optimizer`).

    Args:
        spec: the run (precision, micro-batch, LoRA, attention, checkpointing).
        shape: its model (`model_shape(spec)`).
        mesh: the degrees; with a pipeline degree above 1, rank 0 holds the first stage's tensors
            (:func:`first_stage`).
        seq_len: tokens per sequence (default: the first stage's `max_seq_length`).
        gpu_memory_bytes: one device's memory; sets `fits` (None: unknown).
        layout: the model's tensor-parallel layout (default: :func:`run_layout`, read only for
            a tensor degree above 1).
    """
    if layout is None:
        layout = run_layout(spec) if mesh.tensor > 1 else TensorLayout({})
    b_c = FLOAT_DTYPES[spec.precision.compute][0]
    held = first_stage(shape, mesh.pipeline)
    trainable = [p for p in held if p.trainable]
    shard_t = sum(mesh_shard_elements(p, mesh, layout) for p in trainable)
    frozen = sum(b_c * mesh_shard_elements(p, mesh, layout) for p in held if not p.trainable)
    params = 4 * shard_t + frozen
    grads = 4 * shard_t
    optimizer = 8 * shard_t + 4 * len(trainable)
    local_layers = sum(
        math.prod(tensor_local_shape(p.name, p.shape, mesh.tensor, layout)) for p in shape.params if p.in_layer
    )
    margin = max(local_layers // max(shape.layers, 1), 1) * (2 * b_c + 4)
    heads = mesh.tensor if layout.splits_heads else 1
    adapters = None
    if spec.config.model.lora is not None and mesh.tensor > 1:  # (input features on this rank, r), one layer's
        every = [
            (tensor_local_shape(p.name, p.shape, mesh.tensor, layout)[1], p.shape[0])
            for p in shape.params
            if p.in_layer and ".lora_A." in p.name and len(p.shape) == 2
        ]
        adapters = every[: len(every) // max(shape.layers, 1)]
    kw: dict[str, Any] = dict(residual=b_c, seq_len=seq_len, tensor=mesh.tensor, context=mesh.context, heads=heads)
    kw["lora_modules"] = adapters
    act_ckpt = activation_bytes(shape, spec, checkpointing=True, **kw)
    act_full = activation_bytes(shape, spec, checkpointing=False, **kw)
    entry = assemble(
        mesh_name(mesh),
        spec,
        params=params,
        grads=grads,
        optimizer=optimizer,
        act_ckpt=act_ckpt,
        act_full=act_full,
        margin=margin,
        scaletune={
            "strategy": "fsdp",
            "tensor_parallel": mesh.tensor,
            "context_parallel": mesh.context,
            "pipeline_parallel": mesh.pipeline,
        },
    )
    entry.fits = None if gpu_memory_bytes is None else entry.total <= gpu_memory_bytes
    return entry


@dataclass
class MeshCandidate:
    """One mesh the recommendation looked at: its entry, or why the model or sequence rules it out."""

    mesh: Mesh
    entry: StrategyPlan | None
    ruled_out: str = ""

    def to_json(self) -> dict:
        out: dict[str, Any] = {"mesh": dict(zip(("pipeline", "data_shard", "context", "tensor"), self.mesh.shape))}
        if self.entry is not None:
            out |= {"name": self.entry.name, "per_rank_bytes": self.entry.per_rank_bytes, "fits": self.entry.fits}
        return out | ({"ruled_out": self.ruled_out} if self.ruled_out else {})


@dataclass
class MeshChoice:
    """The recommended degrees for a sequence length: every candidate looked at, in order, up to
    the chosen one (or all, when none fits), and the reason."""

    seq_len: int
    world_size: int
    gpu_memory_bytes: int | None
    candidates: list[MeshCandidate] = field(default_factory=list)
    chosen: MeshCandidate | None = None
    reason: str = ""

    def to_json(self) -> dict:
        return {
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "chosen": None if self.chosen is None else self.chosen.to_json(),
            "candidates": [c.to_json() for c in self.candidates],
            "reason": self.reason,
        }


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def recommend_mesh(
    spec: RunSpec,
    shape: ModelShape,
    hf_config: Any,
    *,
    world_size: int,
    gpus_per_node: int,
    gpu_memory_bytes: int | None,
    seq_len: int | None = None,
) -> MeshChoice:
    """The smallest context degree that fits, at the smallest tensor degree that allows one (see
    the module docstring), over `world_size` ranks with `gpu_memory_bytes` each.

    Args:
        spec: the run; shape: its model; hf_config: its `transformers` config (the mesh's
            model-shape rules, `resolve.mesh.model_mesh_problems`).
        world_size: ranks in the job; gpus_per_node: the largest tensor degree (a tensor group
            stays within a node).
        gpu_memory_bytes: one device's memory (None: nothing is chosen).
        seq_len: tokens per sequence (default: the first stage's `max_seq_length`).
    """
    from scaletune.resolve.mesh import model_mesh_problems

    s = seq_len or spec.batch.max_seq_length
    out = MeshChoice(s, world_size, gpu_memory_bytes)
    layout = TensorLayout.of(hf_config)
    for t in _divisors(world_size):
        if t > max(gpus_per_node, 1):
            break
        for c in _divisors(world_size // t):
            mesh = Mesh(data_shard=world_size // (t * c), context=c, tensor=t)
            problems = [p.message for p in model_mesh_problems(mesh, hf_config)]
            if s % c:
                problems.append(f"the sequence length {s} is not divisible by context {c}")
            if problems:
                out.candidates.append(MeshCandidate(mesh, None, "; ".join(problems)))
                continue
            entry = mesh_entry(spec, shape, mesh, seq_len=s, gpu_memory_bytes=gpu_memory_bytes, layout=layout)
            cand = MeshCandidate(mesh, entry)
            out.candidates.append(cand)
            if cand.entry is not None and cand.entry.fits:
                out.chosen = cand
                out.reason = _reason(out, cand)
                return out
    if gpu_memory_bytes is None:
        out.reason = "no device memory given (--gpu-memory GIB): nothing can be said to fit"
    else:
        sized = [c for c in out.candidates if c.entry is not None]
        best = min(sized, key=lambda c: c.entry.total) if sized else None  # type: ignore[union-attr]
        least = f"; {best.entry.name} needs the least ({best.entry.total / GiB:.1f} GiB)" if best and best.entry else ""
        out.reason = (
            f"no mesh of {world_size} ranks fits {s:,} tokens in {gpu_memory_bytes / GiB:.0f} GiB per device{least}: "
            "add devices, use LoRA or a smaller micro_batch_size"
        )
    return out


def _reason(choice: MeshChoice, cand: MeshCandidate) -> str:
    assert cand.entry is not None and choice.gpu_memory_bytes is not None
    m, gib = cand.mesh, choice.gpu_memory_bytes / GiB
    if not m.model_parallel:
        return (
            f"{choice.seq_len:,} tokens fit without tensor or context parallelism "
            f"({cand.entry.total / GiB:.1f} of {gib:.1f} GiB per device)"
        )
    return (
        f"context_parallel {m.context}, tensor_parallel {m.tensor} is the smallest mesh that fits {choice.seq_len:,} "
        f"tokens: {cand.entry.total / GiB:.1f} of {gib:.1f} GiB per device"
    )


def recommend_for_run(
    spec: RunSpec, shape: ModelShape, *, world_size: int, gpus_per_node: int, gpu_memory_bytes: int | None
) -> MeshChoice | None:
    """:func:`recommend_mesh` for the run's model (its config read as `models.load_config` reads
    it: presets and local folders offline); None for a factory's module (no mesh layout)."""
    from scaletune.models import load_config

    if spec.custom_model or shape.activations is not None:
        return None
    return recommend_mesh(
        spec,
        shape,
        load_config(spec.config.model),
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        gpu_memory_bytes=gpu_memory_bytes,
    )
