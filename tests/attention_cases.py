"""The packed batch, tiny models and the two mean losses that the packed-attention tests share
(tests/unit/test_attention.py, and tests/e2e/test_compile.py for the compiled kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scaletune.models import PRESETS
from scaletune.models.loss import CausalLMLoss

IGN = -100
# Examples per row: row 0 has one 300-token example (a full 128 x 128 block below the diagonal),
# row 1 single-token examples; both end in padding (position 0 at every pad token, as the
# collator writes it). 360 tokens: three 128-blocks, the last one partial.
LENGTHS = [[300, 40, 7], [90, 150, 2, 1, 110]]
T = 360
TOL = 1e-5


def packed_batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """input_ids, labels (-100 on padding and on each example's first token) and position_ids, [2, T]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(LENGTHS), T), generator=g)
    pos = torch.zeros(len(LENGTHS), T, dtype=torch.long)
    labels = torch.full((len(LENGTHS), T), IGN)
    for b, lengths in enumerate(LENGTHS):
        start = 0
        for n in lengths:
            pos[b, start : start + n] = torch.arange(n)
            labels[b, start + 1 : start + n] = ids[b, start + 1 : start + n]
            start += n
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def tiny(preset: str, attn: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    # initializer_range 0.1 (not 0.02): attention far enough from uniform that a leak between
    # examples moves the loss by ~1e-2, a thousand times the tolerance.
    cfg = PRESETS[preset].config(vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)


def transformers_mean_loss(model, batch) -> torch.Tensor:
    """The control: transformers masks the packed rows itself (no attention_mask), mean token loss."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), batch["labels"][:, 1:].reshape(-1))


def scaletune_mean_loss(model, batch) -> torch.Tensor:
    """The trainer's path: CausalLMLoss with no attention_mask builds the packed mask itself."""
    from scaletune.trainer import model_inputs

    inputs = model_inputs(batch)
    assert "attention_mask" not in inputs
    n = int((batch["labels"][:, 1:] != IGN).sum())
    return CausalLMLoss(model)(**inputs) / n
