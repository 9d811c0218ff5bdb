"""The causal-LM loss as a module, so every engine wraps model and loss together.

`CausalLMLoss` runs the decoder, then the output head and cross-entropy only at positions that
have a target, in chunks under activation checkpointing: the full `[tokens, vocab]` logits are
never materialised (in fp32 or at all), which dominates memory and time for large vocabularies
(OLMo-2: 100k; Llama-3: 128k). The same idea as Liger's fused linear cross-entropy
(Hsu et al. 2024, arXiv:2410.10989) and torchtune's chunked output loss, in plain PyTorch.

It sits inside the DDP/FSDP/DeepSpeed wrapper, so the head's parameters are gathered and its
gradients reduced by the engine's own forward hooks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
DEFAULT_CHUNK = 1024  # target positions per head+loss chunk: [1024, vocab] logits at a time


def target_index(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices of positions t whose next token labels[t+1] is a target.

    Computed on the host before the batch moves, so the step needs no device-to-host sync.

    Args:
        labels: [batch, seq] unshifted labels (-100 where not trained).

    Returns:
        [num_targets] int64 indices into the flattened [batch * (seq - 1)] shifted positions.
    """
    return (labels[:, 1:].reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


def _head_ce_sum(hidden: torch.Tensor, weight_holder: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    logits = weight_holder(hidden).float()
    return F.cross_entropy(logits, targets, reduction="sum")


def chunked_head_cross_entropy(
    hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """sum_i CE(head(hidden[i]), targets[i]) without holding more than `chunk` rows of logits.

    Args:
        hidden: [n, hidden_size] final hidden states at target positions.
        head: the output projection (`lm_head`), hidden_size -> vocab.
        targets: [n] int64 token ids.
        chunk: rows per chunk; each chunk's logits are recomputed in backward (checkpointing).

    Returns:
        0-dim float32 sum of the token losses (0 when n == 0, still connected to the graph).
    """
    n = hidden.size(0)
    if n == 0:
        return hidden.sum().float() * 0.0
    total = None
    for start in range(0, n, chunk):
        h, y = hidden[start : start + chunk], targets[start : start + chunk]
        if torch.is_grad_enabled():
            part = checkpoint(_head_ce_sum, h, head, y, use_reentrant=False)
        else:
            part = _head_ce_sum(h, head, y)
        total = part if total is None else total + part
    return total


def _decoder_and_head(causal_lm: nn.Module) -> tuple[nn.Module, nn.Module]:
    base = causal_lm.get_base_model() if hasattr(causal_lm, "get_base_model") else causal_lm  # peft
    return base.get_decoder(), base.get_output_embeddings()


class CausalLMLoss(nn.Module):
    """Wraps a Hugging Face causal LM (or a peft model around one) and returns the summed token loss.

    forward(input_ids [B,T], labels [B,T] unshifted, target_index [n] from :func:`target_index`,
    attention_mask [B,T] | None, position_ids [B,T] | None) -> 0-dim float32 sum of the
    next-token cross-entropy over every target position.

    LoRA layers are injected in place by peft, so running the decoder of the base model runs them.
    """

    def __init__(self, causal_lm: nn.Module, chunk: int = DEFAULT_CHUNK) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.chunk = chunk
        config = getattr(causal_lm, "config", None)
        # Heads that transform logits (Gemma-2 soft-capping, Cohere's logit scale) keep the
        # model's own forward: computing the head here would skip that transform.
        self.plain = bool(getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None))

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        target_index: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.plain:
            logits = self.causal_lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits
            flat = logits[:, :-1, :].reshape(-1, logits.size(-1)).index_select(0, target_index).float()
            return F.cross_entropy(flat, labels[:, 1:].reshape(-1).index_select(0, target_index), reduction="sum")
        decoder, head = _decoder_and_head(self.causal_lm)
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state[:, :-1, :]
        hidden = hidden.reshape(-1, hidden.size(-1)).index_select(0, target_index)
        targets = labels[:, 1:].reshape(-1).index_select(0, target_index)
        return chunked_head_cross_entropy(hidden, head, targets, self.chunk)
