"""Per-sequence log-probabilities of the trained tokens: what every preference loss is built from.

The decoder runs once over the batch; the output head and log-softmax run only at target positions,
in chunks under activation checkpointing (as `models.loss.CausalLMLoss` does for the SFT loss), so
the full ``[rows, T, vocab]`` logits never exist. Each target's log-probability is added to its row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from scaletune.models.loss import decoder_and_head, default_chunk, packed_mask, target_index
from scaletune.resolve.mesh import head_transforms_logits

__all__ = ["over_chunks", "sampling_logits", "sequence_logps", "target_logps", "target_states", "token_logps"]


def sampling_logits(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """THE distribution an online objective samples from and trains on, as logits: `logits` (float32,
    [..., vocab]) divided by `temperature`, then, for `top_p` < 1, the tokens outside the nucleus
    set to -inf by transformers' own `TopPLogitsWarper` (the one `generate` samples through: the
    smallest set of most likely tokens whose probability reaches top_p, the most likely always
    kept), so that a log-softmax renormalises on the kept tokens. The mask carries no gradient;
    the kept logits do.
    """
    if temperature != 1.0:
        logits = logits / temperature
    if top_p < 1.0:
        from transformers import TopPLogitsWarper

        flat = logits.reshape(-1, logits.size(-1))
        logits = TopPLogitsWarper(top_p=top_p)(None, flat).reshape(logits.shape)
    return logits


def _sampled_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log p(targets) [n] under :func:`sampling_logits` of `logits` [n, vocab]. Each target keeps its
    logit even where the nucleus recomputed here leaves it out: it was sampled, so it was in the
    engine's, and a boundary moved by rounding shows as `logp_mismatch`, not as an infinite loss."""
    targets = targets.to(logits.device)
    scaled = sampling_logits(logits, temperature)
    kept = sampling_logits(scaled, 1.0, top_p)
    if top_p < 1.0:
        column = targets.unsqueeze(1)
        kept = kept.scatter(1, column, scaled.gather(1, column))
    return -F.cross_entropy(kept, targets, reduction="none")


def _head_logps(
    hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module, temperature: float = 1.0, top_p: float = 1.0
) -> torch.Tensor:
    return _sampled_logps(head(hidden).float(), targets, temperature, top_p)


def over_chunks(
    fn: Callable[..., torch.Tensor],
    rows: tuple[torch.Tensor, ...],
    fixed: tuple = (),
    *,
    head: nn.Module | None,
    chunk: int | None = None,
    partitioned: bool = False,
    dim: int = 0,
) -> torch.Tensor:
    """``fn(*row_slices, *fixed)`` over chunks of the rows of `rows` (tensors of the same first
    dimension n), concatenated along `dim`: the one rule for running an output head over target
    positions. Each call runs under activation checkpointing while grad is enabled, so only one
    chunk's logits exist at a time, in the forward and in the backward.

    Args:
        head: the output projection whose vocabulary sizes the default chunk
            (`models.loss.default_chunk`); None: `fn` gets logits, one call.
        chunk: rows per call.
        partitioned: the engine gathers the head's weight inside each call (DeepSpeed ZeRO-3): one
            call per micro-batch on every rank, also with no row, since unequal calls deadlock.
    """

    def call(*args: Any) -> torch.Tensor:
        return checkpoint(fn, *args, use_reentrant=False) if torch.is_grad_enabled() else fn(*args)

    n = rows[0].size(0)
    if head is None or partitioned or n == 0:
        return call(*rows, *fixed)
    if chunk is None:
        vocab = getattr(head, "out_features", None) or head.weight.shape[0]
        chunk = default_chunk(vocab, rows[0].device)
    return torch.cat([call(*(r[i : i + chunk] for r in rows), *fixed) for i in range(0, n, chunk)], dim=dim)


def token_logps(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    chunk: int | None = None,
    *,
    partitioned: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """log p(targets[i] | hidden[i]) under `head`, chunk by chunk (:func:`over_chunks`).

    Args:
        hidden: [n, hidden_size] final hidden states at target positions.
        head: the output projection (hidden_size -> vocab).
        targets: [n] int64 token ids.
        chunk: rows per chunk (default `models.loss.default_chunk`).
        partitioned: the engine gathers the head's weight inside each call (DeepSpeed ZeRO-3): one
            call per micro-batch on every rank, also with no target, since unequal calls deadlock.
        temperature: the logits are divided by it first (an online objective's sampling
            temperature: the log-probs of the distribution the completions were drawn from, as TRL's
            GRPOTrainer computes them).
        top_p: below 1, renormalised on the nucleus the completions were sampled from
            (:func:`sampling_logits`).

    Returns:
        [n] float32 log-probabilities (connected to the graph when grad is enabled).
    """
    return over_chunks(
        _head_logps, (hidden, targets), (head, temperature, top_p), head=head, chunk=chunk, partitioned=partitioned
    )


def target_logps(
    causal_lm: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    partitioned_head: bool = False,
    chunk: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The log-probability of every trained token, with the row it belongs to.

    Args:
        causal_lm: a Hugging Face causal LM, or a peft model around one.
        input_ids: [B, T] token ids.
        labels: [B, T] unshifted labels (-100 where not trained): position t predicts labels[t+1].
        attention_mask: [B, T] 1 real, 0 padding (None: packed rows, masked by position_ids).
        position_ids: [B, T].
        partitioned_head: DeepSpeed ZeRO-3 partitions the head (see :func:`token_logps`).
        chunk: head rows per chunk.
        temperature: logits divided by it (see :func:`token_logps`).
        top_p: the nucleus renormalised on (see :func:`token_logps`).

    Returns:
        (per_token [n] float32 on labels' device, in row-major order of the trained positions;
        rows [n] int64: the row of each; tokens [B] int64: trained tokens per row).
    """
    shifted = labels[:, 1:]
    flat = shifted.reshape(-1)
    index = target_index(labels)
    rows = torch.div(index, shifted.size(1), rounding_mode="floor")
    tokens = torch.zeros(labels.size(0), dtype=torch.long, device=labels.device).index_add_(
        0, rows, torch.ones_like(rows)
    )
    states, head = target_states(causal_lm, input_ids, index, attention_mask, position_ids)
    targets = flat.to(states.device).index_select(0, index.to(states.device))
    if head is None:  # the model's own logits
        per_token = _sampled_logps(states.float(), targets, temperature, top_p)
    else:
        per_token = token_logps(
            states, head, targets, chunk, partitioned=partitioned_head, temperature=temperature, top_p=top_p
        )
    return per_token.to(labels.device), rows, tokens


def target_states(
    causal_lm: nn.Module,
    input_ids: torch.Tensor,
    index: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, nn.Module | None]:
    """The decoder's final hidden states at the target positions, and the head that makes them logits.

    Args:
        causal_lm: a Hugging Face causal LM, or a peft model around one.
        input_ids: [B, T] token ids.
        index: [n] int64 flat indices into the [B * (T - 1)] shifted positions (`models.loss.target_index`).
        attention_mask: [B, T] 1 real, 0 padding (None: packed rows, masked by position_ids, or none).
        position_ids: [B, T].

    Returns:
        (hidden [n, hidden_size], head), or, for a head that transforms its logits (Gemma-2's
        soft-capping, Cohere's scale), (logits [n, vocab] from the model's own forward, None).
    """
    config = getattr(causal_lm, "config", None)
    if attention_mask is None and position_ids is not None:
        attention_mask = packed_mask(config, position_ids)
    if head_transforms_logits(config):
        logits = causal_lm(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).logits
        return logits[:, :-1, :].reshape(-1, logits.size(-1)).index_select(0, index.to(logits.device)), None
    decoder, head = decoder_and_head(causal_lm)
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    hidden = out.last_hidden_state[:, :-1, :]
    return hidden.reshape(-1, hidden.size(-1)).index_select(0, index.to(hidden.device)), head


def sequence_logps(
    causal_lm: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    partitioned_head: bool = False,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probability of each row's trained tokens, and how many there are (arguments as
    :func:`target_logps`).

    Returns:
        (logp [B] float32: sum over the row's targets of log p(label), tokens [B] int64: its targets).
    """
    per_token, rows, tokens = target_logps(
        causal_lm, input_ids, labels, attention_mask, position_ids, partitioned_head=partitioned_head, chunk=chunk
    )
    logp = torch.zeros(labels.size(0), dtype=torch.float32, device=labels.device).index_add(0, rows, per_token)
    return logp, tokens
