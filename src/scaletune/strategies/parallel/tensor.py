"""Tensor parallelism (Megatron-LM style, Shoeybi et al. 2019, arXiv:1909.08053) with torch DTensor.

The plan is the model's own: transformers ships `config.base_model_tp_plan` (module-name pattern ->
style name, relative to the base model, e.g. Llama's `layers.*.self_attn.q_proj: colwise`), and
:func:`parallel_style` turns each style name into the torch `ParallelStyle` with the semantics of
transformers' registry (`transformers/distributed/tensor_parallel.py`, ALL_PARALLEL_STYLES). Every
style hands plain local tensors to the model's code (`use_local_output=True`), so HF's attention
(which reshapes to `-1` heads) runs on this rank's heads unchanged.

The output head is column-parallel with its logits left vocab-sharded (a DTensor, `Shard(-1)`):
`models/loss.py` computes the cross-entropy under torch's `loss_parallel()`, so the full logits never
exist on one rank. The input embeddings stay replicated (a plain module; FSDP2 shards them over the
data ranks anyway): a vocab-parallel embedding would save memory only where FSDP does not already,
and costs an all-reduce of every token's vector. A tied head (`tie_word_embeddings`) is the one
exception: its weight is the embedding's, so both become vocab-parallel (`Shard(0)` of the same
`[vocab, hidden]` tensor) and are tied again.

LoRA (peft `LoraLayer`) wraps the targeted Linear: the plan's style then applies to `base_layer`
and to the adapter matrix on the same side of the product. Column-parallel styles shard `lora_B`
(output features) and keep `lora_A` whole; row-parallel styles shard `lora_A` (input features) and
keep `lora_B` whole. The whole factor's gradient is exact on every rank: its output (row-parallel)
or the gradient arriving at it (column-parallel, all-reduced by `DTensor.from_local`'s backward in
the next sharded module's input) is replicated. Dropout on the adapter's input matches across the
ranks of a tensor group because every rank is seeded alike (`trainer.seed_everything`); for a
row-parallel adapter each rank then masks its own slice with the same pattern.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from scaletune.models.introspection import unwrap

if TYPE_CHECKING:  # torch.distributed.tensor is imported where used, by the runs that shard
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

# transformers' style name -> (torch style, the layout that is Replicate() instead of the default), the
# layouts of transformers' ALL_PARALLEL_STYLES; the `_rep` names are its aliases of the gather/split ones.
_STYLES: dict[str, tuple[str, str | None]] = {
    # weight Shard(0); input replicated; output sharded on its features.
    "colwise": ("ColwiseParallel", None),
    # weight Shard(1); input sharded on its features; output all-reduced (replicated).
    "rowwise": ("RowwiseParallel", None),
    # colwise, then the output features all-gathered (OLMo-2's q/k/v: q_norm/k_norm span all heads).
    "colwise_gather_output": ("ColwiseParallel", "output_layouts"),
    "colwise_rep": ("ColwiseParallel", "output_layouts"),
    # the input is replicated and each rank keeps its slice (no communication), then rowwise.
    "rowwise_split_input": ("RowwiseParallel", "input_layouts"),
    "rowwise_rep": ("RowwiseParallel", "input_layouts"),
}
_COLUMN = frozenset(name for name, (style, _) in _STYLES.items() if style == "ColwiseParallel")


def parallel_style(name: str) -> ParallelStyle:
    """The torch `ParallelStyle` for a transformers tensor-parallel style name (`use_local_output=True`).

    Raises:
        ValueError: a style this module does not map (packed, MoE, sequence-parallel, embedding...).
    """
    from torch.distributed.tensor import Replicate, parallel

    if name not in _STYLES:
        raise ValueError(
            f"tensor parallelism: style {name!r} of the model's base_model_tp_plan is not supported "
            f"(supported: {', '.join(sorted(_STYLES))})"
        )
    style, replicated = _STYLES[name]
    return getattr(parallel, style)(**({replicated: Replicate()} if replicated else {}))


def base_model(causal_lm: nn.Module) -> nn.Module:
    """The decoder the plan's names are relative to: `model.model` of a CausalLM (its
    `base_model_prefix` attribute), under a peft wrapper too."""
    hf = unwrap(causal_lm)
    return getattr(hf, getattr(hf, "base_model_prefix", ""), hf)


def matches_plan_key(name: str, pattern: str) -> bool:
    """A dotted module name against a plan key, `*` standing for one whole name part."""
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, p) for a, p in zip(parts, pats, strict=True))


def _is_lora(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)


def tensor_parallel_plan(causal_lm: nn.Module) -> dict[str, str]:
    """The base model's plan expanded to concrete module names, LoRA layers split into their parts.

    Returns:
        {module name relative to :func:`base_model`: transformers style name}, e.g.
        `layers.0.self_attn.q_proj` (no LoRA) or `layers.0.self_attn.q_proj.base_layer` and
        `layers.0.self_attn.q_proj.lora_B.default` (LoRA).

    Raises:
        ValueError: the model ships no plan, a style is not supported, LoRA uses DoRA (its
            magnitude normalises the whole merged weight row), or a key matches no module.
    """
    config = getattr(unwrap(causal_lm), "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"tensor parallelism: {type(unwrap(causal_lm)).__name__} has no base_model_tp_plan")
    for style in plan.values():
        parallel_style(style)  # refuse unknown styles before touching the model
    base = base_model(causal_lm)
    expanded: dict[str, str] = {}
    for pattern, style in plan.items():
        names = [n for n, _ in base.named_modules() if n and matches_plan_key(n, pattern)]
        if not names:
            raise ValueError(f"tensor parallelism: plan key {pattern!r} matches no module of {type(base).__name__}")
        for name in names:
            module = base.get_submodule(name)
            if not _is_lora(module):
                expanded[name] = style
                continue
            if any(getattr(module, "use_dora", {}).values()):
                raise ValueError(f"tensor parallelism: DoRA on {name} is not supported")
            expanded[f"{name}.base_layer"] = style
            side = "lora_B" if style in _COLUMN else "lora_A"
            for adapter in getattr(module, side):
                expanded[f"{name}.{side}.{adapter}"] = style
    return expanded


def _check_divisible(causal_lm: nn.Module, plan: dict[str, str], size: int) -> None:
    """Sharded widths must divide by the tensor-parallel size: the styles' `from_local` assume even
    shards, and a colwise attention projection must hold whole heads."""
    base, config = base_model(causal_lm), unwrap(causal_lm).config
    for name, style in plan.items():
        module = base.get_submodule(name)
        width = module.out_features if style in _COLUMN else module.in_features
        if width % size:
            raise ValueError(f"tensor parallelism: {name} ({style}) has {width} features, not divisible by {size}")
    if "colwise" in plan.values():
        for field in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(config, field, None)
            if heads is not None and heads % size:
                raise ValueError(f"tensor parallelism: {field}={heads} is not divisible by tensor_parallel={size}")
    vocab = unwrap(causal_lm).get_output_embeddings().weight.shape[0]
    if vocab % size:
        raise ValueError(f"tensor parallelism: vocabulary size {vocab} is not divisible by tensor_parallel={size}")


def apply_tensor_parallel(causal_lm: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard `causal_lm` (a transformers CausalLM, or a peft model around one) over `tp_mesh` in place.

    Works on a meta-device model (parameters become meta DTensors; fill them afterwards, e.g. with
    `set_model_state_dict(..., broadcast_from_rank0=True)`) as on a materialised one (each rank keeps
    its shard of rank 0's weights). Call before FSDP2's `fully_shard`.

    Args:
        causal_lm: the model; its `config.base_model_tp_plan` says what to shard.
        tp_mesh: the one-dimensional tensor-parallel mesh (`mesh["tensor"]`).

    Raises:
        ValueError: see :func:`tensor_parallel_plan`; a sharded width, the head count or the vocabulary
            not divisible by the mesh size; an output head that is not a plain `nn.Linear`.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = tensor_parallel_plan(causal_lm)
    _check_divisible(causal_lm, plan, tp_mesh.size())
    base = base_model(causal_lm)
    for name, style in plan.items():
        parallelize_module(base.get_submodule(name), tp_mesh, parallel_style(style))
    hf = unwrap(causal_lm)
    head, embed = hf.get_output_embeddings(), hf.get_input_embeddings()
    if type(head) is not nn.Linear:
        raise ValueError(f"tensor parallelism: the output head is a {type(head).__name__}, not a plain Linear")
    # `Module.to("meta")` unties the two (a new Parameter per module): the config says it too.
    tied = head.weight is embed.weight or bool(getattr(hf.config, "tie_word_embeddings", False))
    if tied and head.weight.shape != embed.weight.shape:
        raise ValueError("tensor parallelism: tied head and embeddings of different shapes")
    # Vocab-sharded logits, kept a DTensor for loss_parallel (models/loss.py).
    parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    if tied:
        # Vocab-parallel lookup (weight Shard(0), the partial rows summed), then the same parameter.
        parallelize_module(embed, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
        head.weight = embed.weight


def grad_norm_and_clip(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """The total gradient norm over all ranks' shards, and the gradients scaled to at most `max_norm`.

    torch's `clip_grad_norm_` stacks the per-parameter norms, which fails for DTensors on different
    meshes (tensor-parallel weights on data_context x tensor, the rest on data_context). Here the
    norms are taken per (mesh, placements) group (`torch.nn.utils.get_total_norm`, foreach kernels),
    each group's norm made whole (`full_tensor`: the partial norms reduced over the group's mesh), and
    the groups' norms combined the same way (the p-norm of p-norms is the p-norm of all). Plain
    tensors (replicated parameters outside any mesh) count as whole on this rank. The scaling is
    torch's `clip_grads_with_norm_` (clip coefficient max_norm / (total + 1e-6), at most 1).

    Args:
        params: the trainable parameters (those without a gradient are skipped).
        max_norm: the largest allowed total norm; `inf` measures without scaling.
        norm_type: p of the p-norm (`inf` for the max norm).

    Returns:
        0-dim plain tensor: the total norm before clipping, the same on every rank.
    """
    from torch.distributed.tensor import DTensor, Replicate

    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    device = params[0].grad.device
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).to(device))
    total = torch.nn.utils.get_total_norm(norms, norm_type)
    if max_norm != float("inf"):
        for key, group in groups.items():
            # torch's foreach ops refuse a mix of DTensors and plain tensors: the total as a replicated
            # DTensor on each group's mesh.
            mesh = None if key is None else key[0]
            norm = (
                total if mesh is None else DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)
            )
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return total
