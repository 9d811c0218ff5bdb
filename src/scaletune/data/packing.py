"""Packing: consecutive examples concatenated into rows of at most max_seq_length, and the check
that the attention implementation keeps packed examples apart."""

from __future__ import annotations

from scaletune.errors import ConfigError
from scaletune.resolve import packing_problems

# Examples are packed within chunks of this many (consecutive) examples, to bound memory.
PACK_CHUNK = 10_000


def pack_rows(batch: dict[str, list], max_len: int) -> dict[str, list]:
    """Greedy, order-preserving packing of consecutive examples into rows of at most max_len."""
    out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    cur: dict[str, list] = {k: [] for k in out}
    for ids, labels, pos in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
        if cur["input_ids"] and len(cur["input_ids"]) + len(ids) > max_len:
            for k in out:
                out[k].append(cur[k])
            cur = {k: [] for k in out}
        cur["input_ids"] += ids
        cur["labels"] += labels
        cur["position_ids"] += pos
    if cur["input_ids"]:
        for k in out:
            out[k].append(cur[k])
    return out


def check_packing_support(attn_implementation: str | None, micro_batch_size: int) -> None:
    """Raise if packed rows would attend across examples with this attention implementation (the
    rule is :func:`scaletune.resolve.packing_problems`, which a resolved run has already passed).

    Raises:
        ConfigError: naming data.packing and model.attn_implementation.
    """
    problems = packing_problems(attn_implementation, micro_batch_size)
    if problems:
        raise ConfigError([p.text() for p in problems], title="invalid config")
