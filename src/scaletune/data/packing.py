"""Packing: consecutive examples concatenated into rows of at most max_seq_length, and the check
that the attention implementation keeps packed examples apart."""

from __future__ import annotations

from scaletune.errors import ConfigError

# Examples are packed within chunks of this many (consecutive) examples, to bound memory.
_PACK_CHUNK = 10_000
# Attention implementations that build their mask through transformers' masking_utils, which
# separates packed sequences by position_ids when no attention_mask is given.
_PACKING_SAFE_ATTENTION = ("sdpa", "eager", "flex_attention")


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
    """Raise if packed rows would attend across examples with this attention implementation.

    transformers (5.x) keeps packed examples apart only when it is given no attention_mask and
    position_ids restart at each example: ``masking_utils`` then builds a block-diagonal causal
    mask for sdpa, eager and flex_attention. The flash-attention kernels read packing from
    position_ids only for a batch of ONE row (``_is_packed_sequence``); with more rows they would run
    plain causal attention across the examples of a row. Other (custom) implementations get no mask.

    Raises:
        ConfigError: naming data.packing and model.attn_implementation.
    """
    impl = attn_implementation or "sdpa"
    if impl in _PACKING_SAFE_ATTENTION:
        return
    if impl.startswith("flash_attention") and micro_batch_size == 1:
        return
    if impl.startswith("flash_attention"):
        raise ConfigError(
            f"data.packing with model.attn_implementation {impl} keeps packed examples apart only with "
            f"training.micro_batch_size 1 (it is {micro_batch_size}); set micro_batch_size: 1, or use sdpa",
            title="invalid config",
        )
    raise ConfigError(
        f"data.packing: model.attn_implementation {impl} cannot keep packed examples apart (attention would "
        f"leak between them); use one of {', '.join(_PACKING_SAFE_ATTENTION)} or set data.packing: false",
        title="invalid config",
    )
