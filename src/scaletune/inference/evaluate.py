"""Loss and perplexity of a model on a data set, tokenized and masked exactly as training does
(the data package's encoder and collator, the training loss module)."""

from __future__ import annotations

import math
from typing import Any

from scaletune.config import DataConfig, DataSource
from scaletune.inference.loading import LoadedModel


def eval_data_config(
    loaded: LoadedModel, path: str, fmt: str | None, max_seq_length: int | None, field: str | None = None
) -> DataConfig:
    """The `data` section that reads `path` as training would: format, alpaca template, chat
    template and max_seq_length default to the run's (else alpaca, the model's prompt format, 1024)."""
    run = loaded.data
    run_src = run.train if run is not None and run.train is not None else None
    fmt = fmt or (run_src.format if run_src else "alpaca")
    template = "chat" if fmt == "alpaca" and loaded.template == "chat" else "alpaca"
    source = DataSource(path=path, format=fmt, template=template, field=field)  # type: ignore[arg-type]
    return DataConfig(
        train=source,
        max_seq_length=max_seq_length or (run.max_seq_length if run is not None else 1024),
        chat_template=loaded.chat_template,
    )


def evaluate(loaded: LoadedModel, data_cfg: DataConfig, *, batch_size: int = 8) -> dict[str, Any]:
    """Mean next-token loss over every trained (unmasked) token of the data set, and its exponential.

    Returns:
        `loss` (nats per target token, the same mean as `eval_loss` in metrics.jsonl), `perplexity`
        (exp of it), `target_tokens`, `examples` (after dropping those left with no target),
        `truncated` (examples cut at max_seq_length).

    Raises:
        DataError: the data cannot be read or leaves nothing to evaluate.
    """
    import torch

    from scaletune.data import Collator, build_datasets, count_target_tokens
    from scaletune.models import max_positions
    from scaletune.models.loss import CausalLMLoss, target_index

    tok = loaded.tokenizer
    base = getattr(loaded.model, "get_base_model", lambda: loaded.model)()
    bundle = build_datasets(data_cfg, tok, seed=0, max_positions=max_positions(base.config))
    rows = bundle.train
    collate = Collator(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    loss_fn = CausalLMLoss(loaded.model)
    total, targets = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = collate([rows[i] for i in range(start, min(start + batch_size, len(rows)))])
            inputs = {k: v.to(loaded.device) for k, v in batch.items()}
            inputs["target_index"] = target_index(batch["labels"]).to(loaded.device)
            total += float(loss_fn(**inputs))
            targets += count_target_tokens(batch["labels"])
    loss = total / max(targets, 1)
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "target_tokens": targets,
        "examples": len(rows),
        "truncated": bundle.stats.get("truncated", 0),
    }
