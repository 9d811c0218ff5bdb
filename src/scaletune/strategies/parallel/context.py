"""Context (sequence) parallelism with exact attention, in the DeepSpeed-Ulysses style.

Jacobs et al. 2023, "DeepSpeed Ulysses" (arXiv:2309.14509). The ``cp`` ranks of a context group
each hold one contiguous slice of every row of a micro-batch (:func:`split_batch`). Everything
but attention is per token, so each rank runs the decoder on its slice alone. Around each
attention call an all-to-all trades the sequence split for a head split: each rank then holds
``H / cp`` query heads (and ``KV / cp`` key/value heads) over the whole row, runs attention
exactly, and a second all-to-all trades back (:func:`ulysses_attention`). Both all-to-alls are
``torch.distributed.nn.functional.all_to_all_single``, which is differentiable (its backward is the
reverse all-to-all) and runs over NCCL and gloo alike.

Why not torch's ring attention (``torch.distributed.tensor.experimental.context_parallel``): it
works by giving DTensor sharding rules to the CUDA SDPA kernels, and on the CPU it fails at the
first attention call ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not
have a sharding strategy registered", torch 2.13, gloo), so it could be neither run nor tested
on CPUs.

What a rank computes, and why the sum over ranks is the whole batch's loss:

* the slice ``[a, b)`` of ``input_ids`` and ``position_ids`` (rotary gets the true positions);
* ``labels[a : b + 1]``, one longer than the slice, so the last local position keeps its target
  (the next slice's first token): ``loss.CausalLMLoss`` then scores every local position with
  ``labels[:, 1:]`` and ``loss.target_index`` of these labels indexes the ``[B * L]`` local
  positions. The slices' targets partition the row's targets;
* attention over the whole row: causal (``is_causal``) for unpacked rows, whose padding is on the
  right, after every real token, so no real token attends to it and no 2-D mask is needed; the
  document mask of ``models.attention.packed_mask``, built from the whole row's position ids
  (``full_position_ids``), for packed rows.

Limits: the model must be a transformers model dispatching attention through
``AttentionInterface`` with plain causal attention in every layer (no sliding window, chunks,
logit soft-capping in attention); ``H`` and ``KV`` divisible by ``cp``; attention runs in
transformers' ``sdpa_attention_forward`` whatever implementation the model was loaded with, and
packed rows get a dense ``[B, 1, T, T]`` boolean mask. One context group per process.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from scaletune.data.sources import IGNORE_INDEX
from scaletune.models.attention import full_causal_only
from scaletune.models.introspection import unwrap

log = logging.getLogger(__name__)

#: The attention implementation :func:`install` registers and switches the model to.
ATTENTION = "scaletune_ulysses"

#: The micro-batch keys :func:`split_batch` knows how to cut (a text `data.batching.Collator` batch).
SPLIT_KEYS = frozenset({"input_ids", "labels", "attention_mask", "position_ids", "target_index"})


def _real_tokens(mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, T] bool, True at non-padding tokens, read as `data.batching.count_input_tokens` reads
    them: the 2-D mask when there is one, else all up to the last position that is not 0."""
    input_ids = mb["input_ids"]
    if "attention_mask" in mb:
        return mb["attention_mask"].bool()
    if "position_ids" not in mb:
        return torch.ones_like(input_ids, dtype=torch.bool)
    pos = mb["position_ids"]
    idx = torch.arange(1, pos.shape[1] + 1, device=pos.device)
    length = (idx * (pos != 0)).amax(dim=1)
    return idx[None, :] <= length[:, None]


def split_batch(mb: dict[str, torch.Tensor], cp_rank: int, cp_size: int) -> dict[str, torch.Tensor]:
    """This context rank's slice of a text micro-batch (a `data.batching.Collator` batch).

    The rows are padded on the right to ``T' = cp_size * L`` (``L = ceil(T / cp_size)``; input id
    0, label -100, position 0 and padding in the masks, as the collator pads), and rank ``r`` gets
    positions ``[r L, (r + 1) L)``. With ``Collator(pad_to_multiple_of=cp_size)`` no padding is
    added here.

    Summed over the ``cp_size`` slices, `trainer.batches.TEXT`'s counts (targets: ``labels[:, 1:]``
    not -100; tokens: the ``attention_mask`` sum) equal those of the whole micro-batch.

    Args:
        mb: ``input_ids`` and ``labels`` (unshifted, -100 not trained) ``[B, T]`` int64, and
            optionally ``position_ids`` ``[B, T]`` (restarting at 0 per example in packed rows),
            ``attention_mask`` ``[B, T]`` (1 real, 0 padding; present only for unpacked rows, as
            the collator does), ``target_index`` (dropped: it indexes the whole rows;
            `trainer.batches.model_inputs` computes the slice's from its labels).
        cp_rank: this rank's index in its context group, ``0 <= cp_rank < cp_size``.
        cp_size: ranks in the context group.

    Returns:
        ``input_ids`` ``[B, L]``; ``labels`` ``[B, L + 1]`` (this slice's and the next token's:
        `loss.target_index` of them indexes the ``[B * L]`` local positions); ``position_ids`` ``[B, L]`` (``0..T'-1`` for rows that had none);
        ``attention_mask`` ``[B, L]`` int64, 1 at real tokens (for counting tokens only:
        `loss.CausalLMLoss` does not give it to attention, see the module docstring); and for
        packed rows (no ``attention_mask`` in `mb`) ``full_position_ids`` ``[B, T']``, the whole
        padded rows' positions, from which attention builds the document mask (it must reach
        `CausalLMLoss.forward`: without it packed examples would attend to each other).

    Raises:
        ValueError: a key other than :data:`SPLIT_KEYS`, a rank outside the group, or an
            ``attention_mask`` with padding on the left (causal attention over the whole row
            would then let real tokens see padding).
    """
    unknown = sorted(set(mb) - SPLIT_KEYS)
    if unknown:
        raise ValueError(f"context parallelism splits text micro-batches only; cannot split {unknown}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"context rank {cp_rank} is not in a group of {cp_size}")
    input_ids, labels = mb["input_ids"], mb["labels"]
    batch, length = input_ids.shape
    if "attention_mask" in mb:
        mask = mb["attention_mask"]
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError("context parallelism needs right padding; this micro-batch is padded on the left")
    real = _real_tokens(mb)
    local = -(-length // cp_size)
    pad = local * cp_size - length
    start, stop = cp_rank * local, (cp_rank + 1) * local
    if "position_ids" in mb:
        positions = F.pad(mb["position_ids"], (0, pad), value=0)
    else:
        positions = torch.arange(length + pad, device=input_ids.device).expand(batch, length + pad)
    out = {
        "input_ids": F.pad(input_ids, (0, pad), value=0)[:, start:stop],
        # One past the slice (and -100 past the row's end): the last local position's target.
        "labels": F.pad(labels, (0, pad + 1), value=IGNORE_INDEX)[:, start : stop + 1],
        "position_ids": positions[:, start:stop],
        "attention_mask": F.pad(real.long(), (0, pad), value=0)[:, start:stop],
    }
    if "attention_mask" not in mb and "position_ids" in mb:
        out["full_position_ids"] = positions
    return out


def _seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, H, L, D] (this rank's positions, all heads) -> [B, H / cp, cp L, D] (all positions,
    this rank's heads). Chunk ``j`` of the all-to-all's dim 0 goes to rank ``j``: head group ``j``
    out, sequence slice ``j`` in, concatenated in rank order, which is the order of the slices."""
    from torch.distributed.nn.functional import all_to_all_single

    cp = torch.distributed.get_world_size(group)
    b, h, length, d = x.shape
    x = x.reshape(b, cp, h // cp, length, d).transpose(0, 1).contiguous()  # [cp, B, H/cp, L, D]
    y = all_to_all_single(torch.empty_like(x), x, group=group)  # [cp (slice), B, H/cp, L, D]
    return y.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * length, d)


def _heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, cp L, H / cp, D] (attention's output: all positions, this rank's heads) ->
    [B, L, H, D] (this rank's positions, all heads): the inverse of :func:`_seq_to_heads`."""
    from torch.distributed.nn.functional import all_to_all_single

    cp = torch.distributed.get_world_size(group)
    b, t, hc, d = x.shape
    x = x.reshape(b, cp, t // cp, hc, d).transpose(0, 1).contiguous()  # [cp (slice), B, L, H/cp, D]
    y = all_to_all_single(torch.empty_like(x), x, group=group)  # [cp (head group), B, L, H/cp, D]
    return y.permute(1, 2, 0, 3, 4).reshape(b, t // cp, cp * hc, d)


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    group: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Exact attention over whole rows from this rank's slice of them (an ``AttentionInterface``
    function; :func:`install` registers it with `group` bound).

    Args:
        module: the attention layer (transformers reads ``is_causal`` and
            ``num_key_value_groups`` from it).
        query: ``[B, H, L, D]`` this rank's positions; key, value: ``[B, KV, L, D]``.
        attention_mask: None (causal) or `models.attention.context_mask`'s ``[B, 1, cp L, cp L]``.
        group: the context group (``cp`` ranks, each with the same ``B`` and ``L``).
        kwargs: passed on to transformers' ``sdpa_attention_forward`` (``scaling``, ``dropout``).

    Returns:
        (``[B, L, H, D]`` attention output at this rank's positions, None): transformers' contract.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = (_seq_to_heads(t, group) for t in (query, key, value))
    out, _ = sdpa_attention_forward(module, q, k, v, attention_mask, **kwargs)  # [B, cp L, H/cp, D]
    return _heads_to_seq(out, group), None


def install(causal_lm: nn.Module, cp_group: Any) -> None:
    """Switch `causal_lm`'s attention to :func:`ulysses_attention` over `cp_group`.

    Registers :data:`ATTENTION` with transformers' ``AttentionInterface`` (process-wide: one
    context group per process) and sets it with ``set_attn_implementation``; the saved config
    does not keep it (transformers drops ``_attn_implementation_internal`` when serialising).

    Args:
        causal_lm: a transformers causal LM, or a peft model around one.
        cp_group: the process group of this rank's context ranks (its size is ``cp``).

    Raises:
        ValueError: attention heads or key/value heads not divisible by ``cp``, layers that are
            not all plain causal attention, or a model that does not dispatch attention through
            ``AttentionInterface``.
    """
    from transformers import AttentionInterface

    base = unwrap(causal_lm)  # under peft
    config = base.config
    cp = torch.distributed.get_world_size(cp_group)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % cp or kv_heads % cp:
        raise ValueError(
            f"context parallelism over {cp} ranks needs heads ({heads}) and KV heads ({kv_heads}) divisible by {cp}"
        )
    if not full_causal_only(config):
        raise ValueError(
            f"{type(config).__name__} has layers other than full causal attention; context parallelism needs only those"
        )
    previous = config._attn_implementation
    AttentionInterface.register(ATTENTION, functools.partial(ulysses_attention, group=cp_group))
    base.set_attn_implementation(ATTENTION)
    if config._attn_implementation != ATTENTION:
        raise ValueError(f"{type(base).__name__} does not dispatch attention through transformers' AttentionInterface")
    log.info(
        f"context parallelism over {cp} ranks: Ulysses all-to-all around sdpa (the model was loaded with {previous})"
    )
