"""Attention for packed rows: which kernel a run uses, and the mask each micro-batch gets.

A packed row holds several examples; each must attend only to itself. transformers masks packed
rows on its own when it gets no ``attention_mask`` and ``position_ids`` that restart per example
(``masking_utils.find_packed_sequence_indices``), but in every forward it rebuilds the mask and
tests the rows on the host (``(...).all()``: a device-to-host sync per step on a GPU).

* :func:`packed_attention`: the `attn_implementation` a run loads with, chosen once at start and
  logged. With packing and `model.attn_implementation` left at its default, a CUDA run gets
  ``flex_attention`` (block-sparse: masked-out 128 x 128 blocks are skipped, no dense
  ``[B, 1, T, T]`` mask) where torch and the model class support it; the CPU keeps ``sdpa``,
  because torch refuses flex_attention's backward there ("FlexAttention does not support backward
  on CPU", torch 2.5 to 2.13 at least).
* :func:`packed_mask`: the mask of one packed micro-batch, built once per forward from
  position_ids on their device (no host sync) and passed to the model as a 4D mask, which
  transformers uses as-is for every layer: a `BlockMask` for ``flex_attention``, the same boolean
  ``[B, 1, T, T]`` mask transformers would build for ``sdpa``.
* :func:`context_mask`: the whole rows' mask of a context-parallel slice (the strategy splits the
  rows, `strategies.parallel.context`; the loss module asks for their mask here).
* :func:`causal_sdpa`: unpacked right-padded rows, which need no mask at all under causal
  attention, run SDPA's `is_causal` without transformers' per-forward packed-rows check.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from scaletune.config import ModelConfig

log = logging.getLogger(__name__)

FLEX = "flex_attention"
SDPA = "sdpa"

# The masks packed_mask builds; any other implementation keeps transformers' own mask work.
PREBUILT = (FLEX, SDPA)

#: transformers' own SDPA attention under a name its mask interface does not know
#: (:func:`causal_sdpa`). Not a value for `model.attn_implementation` (`models.checks` refuses it).
CAUSAL_SDPA = "scaletune_causal_sdpa"


def flex_unavailable(hf_config: Any, device: str) -> str | None:
    """Why flex_attention cannot train this model on `device` (None: it can).

    Args:
        hf_config: the model's `transformers` config (its class and attention dropout matter).
        device: where the model computes, ``"cpu"`` or ``"cuda:N"``.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_torch_flex_attn_available

    if not device.startswith("cuda"):
        return f"torch {torch.__version__} has no flex_attention backward on the CPU"
    if not is_torch_flex_attn_available():
        return f"this torch ({torch.__version__}) has no flex_attention"
    model_class = AutoModelForCausalLM._model_mapping.get(type(hf_config), None)
    if model_class is None or not getattr(model_class, "_supports_flex_attn", False):
        return f"transformers' {getattr(model_class, '__name__', type(hf_config).__name__)} does not support flex_attention"
    if float(getattr(hf_config, "attention_dropout", 0.0) or 0.0) > 0:
        return "the model has attention dropout, which transformers' flex_attention refuses"
    return None


def packed_attention(model: ModelConfig, hf_config: Any, *, packing: bool, device: str) -> str | None:
    """The `attn_implementation` a run loads its model with, logged once when rows are packed.

    The configured value, except with packed rows and `model.attn_implementation` not written in
    the config (its default, sdpa): then ``flex_attention`` where :func:`flex_unavailable` finds
    nothing against it, else ``sdpa``. A written value is kept as it is, so ``sdpa`` can always be
    asked for.

    Args:
        model: `model:` of the config (`model_fields_set` tells written from default).
        hf_config: the model's `transformers` config.
        packing: some stage packs its rows (`data.packing`).
        device: where the model computes, ``"cpu"`` or ``"cuda:N"``.
    """
    configured = model.attn_implementation
    if not packing:
        return configured
    if "attn_implementation" in model.model_fields_set:
        log.info(f"attention for packed rows: {configured} (model.attn_implementation)")
        return configured
    why_not = flex_unavailable(hf_config, device)
    if why_not is None:
        log.info(
            f"attention for packed rows: {FLEX}, a block mask built once per micro-batch "
            f"(default on CUDA; model.attn_implementation: sdpa keeps the dense mask)"
        )
        return FLEX
    log.info(f"attention for packed rows: {SDPA} with a dense block-diagonal mask ({why_not})")
    return SDPA


def sequence_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which example of its row each token belongs to: ``[B, T]`` int64, counting from 0 in each row.

    A new example starts wherever the position does not follow the previous one by 1, the rule of
    transformers' ``find_packed_sequence_indices`` (so every padding token, at position 0, is an
    example of its own and no softmax row is fully masked).
    """
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def full_causal_only(hf_config: Any) -> bool:
    """Every layer is plain causal attention over the whole row: the one mask fits all layers.
    Sliding-window, chunked or bidirectional layers keep transformers' own masks. A vision-language
    model's layers are its language model's (`get_text_config`)."""
    if hasattr(hf_config, "get_text_config"):
        hf_config = hf_config.get_text_config()
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        windowed = any(t != "full_attention" for t in layer_types)
    else:
        windowed = getattr(hf_config, "sliding_window", None) is not None
    return (
        not windowed
        and getattr(hf_config, "attention_chunk_size", None) is None
        and getattr(hf_config, "is_causal", True)
    )


def packed_mask(hf_config: Any, position_ids: torch.Tensor) -> Any:
    """The 4D attention mask of a packed micro-batch, or None to leave it to transformers.

    Built on `position_ids`' device with no host sync. Token q attends to k iff k <= q and both
    are in the same example (:func:`sequence_ids`), which is transformers' packed mask.

    Args:
        hf_config: the model's config; its ``_attn_implementation`` picks the mask's form.
        position_ids: ``[B, T]`` int64, restarting at 0 at each packed example.

    Returns:
        ``flex_attention``: a `torch.nn.attention.flex_attention.BlockMask` of shape ``[B, 1, T, T]``
        (128 x 128 blocks). ``sdpa``: a bool ``[B, 1, T, T]`` tensor (True: attend). None for other
        implementations or models with other than full causal layers (:func:`full_causal_only`).
    """
    impl = getattr(hf_config, "_attn_implementation", None)
    if impl not in PREBUILT or not full_causal_only(hf_config):
        return None
    seq = sequence_ids(position_ids)
    batch, length = seq.shape
    if impl == SDPA:
        causal = torch.ones(length, length, dtype=torch.bool, device=seq.device).tril()
        return ((seq[:, :, None] == seq[:, None, :]) & causal)[:, None]
    from torch.nn.attention.flex_attention import create_block_mask

    def same_example_causal(b, h, q, k):
        return (k <= q) & (seq[b, q] == seq[b, k])

    # Not compiled: the dense [B, 1, T, T] boolean is made once per micro-batch and freed at once
    # (the sdpa path keeps one for the whole forward and backward); compiling would recompile for
    # every new row length.
    return create_block_mask(same_example_causal, batch, None, length, length, device=seq.device)


def flex_attention_in_autocast_dtype(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' ``flex_attention_forward`` with query, key and value in the autocast dtype.

    Under `torch.autocast` the projections come out in the compute dtype, but a model whose rotary
    embedding is computed in the residual stream's dtype (Llama, Qwen2, Mistral: ``cos``/``sin``
    cast to the fp32 hidden states, ``q * cos`` promoted) hands attention fp32 queries and keys
    next to a bf16 value. SDPA is on autocast's cast list and evens them out; flex_attention is
    not, so it runs fp32 attention or refuses the mix. Measured on the CPU with a Llama of
    scaletune's `llama-tiny` preset under ``torch.autocast("cpu", torch.bfloat16)``: fp32, fp32 and
    bf16 before this cast.

    Args:
        query, key, value: ``[B, H, T, D]`` (key and value ``[B, H_kv, T, D]``), any float dtypes.
        attention_mask, kwargs: as transformers' attention interface passes them.

    Returns:
        transformers' ``(output, weights)``.
    """
    from transformers.integrations import flex_attention as hf_flex

    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    return hf_flex.flex_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_autocast_flex_attention() -> None:
    """Register :func:`flex_attention_in_autocast_dtype` as transformers' ``flex_attention``
    (`AttentionInterface`, read at each layer's forward), for every model in this process. Outside
    autocast it is transformers' own function unchanged."""
    from transformers import AttentionInterface

    AttentionInterface.register(FLEX, flex_attention_in_autocast_dtype)


class _AsSdpa:
    """A read-only view of a transformers config that names ``sdpa`` as its attention, so
    `packed_mask` builds the mask that `strategies.parallel.context.ulysses_attention` hands to sdpa."""

    _attn_implementation = SDPA

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def context_mask(hf_config: Any, full_position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The attention mask of the whole rows of a context-parallel micro-batch.

    Args:
        hf_config: the model's transformers config.
        full_position_ids: ``[B, T']`` the whole padded rows' position ids of packed rows
            (`strategies.parallel.context.split_batch`'s ``full_position_ids``), or None for unpacked rows.

    Returns:
        None for unpacked rows (attention is causal: `strategies.parallel.context`'s docstring); for packed rows
        :func:`packed_mask`'s boolean ``[B, 1, T', T']`` document mask (True: attend).
    """
    if full_position_ids is None:
        return None
    mask = packed_mask(_AsSdpa(hf_config), full_position_ids)
    assert mask is not None, "parallel.context.install() refuses models whose layers are not all plain causal attention"
    return mask


@contextlib.contextmanager
def causal_sdpa(hf_config: Any) -> Iterator[None]:
    """Within it, an ``sdpa`` model's language-model layers build no mask: SDPA runs `is_causal`.

    For unpacked right-padded rows of a model whose layers are all plain causal attention
    (:func:`full_causal_only`), passed to the model with no attention mask and no position ids
    (`models.loss.CausalLMLoss`). transformers still asks, once per forward, whether the positions
    it makes for them are packed rows: ``(packed_sequence_mask[:, -1] == 0).all()`` in
    `masking_utils.find_packed_sequence_indices`, a device-to-host sync every micro-batch on a GPU
    (seen on an H200 with transformers 5.17; 5.24 line 761). Its mask preparation
    (`masking_utils._preprocess_mask_arguments`) returns no mask, before that check, for an
    attention name its `AttentionMaskInterface` does not know; under :data:`CAUSAL_SDPA`, the
    layers then call transformers' own `sdpa_attention_forward` with no mask, which passes
    ``is_causal=True`` for a query longer than one token: the attention ``sdpa`` computes for these
    rows, less the check.

    Scoped to the forward because generation shares the config and needs its left padding's mask.
    Gradient checkpointing recomputes a layer in backward, outside this context, under ``sdpa``
    with the same None mask: the same `is_causal` call. Other implementations, and a config that is
    not ``sdpa``, are left as they are. The name is registered with transformers'
    `AttentionInterface` (process-wide) on first use.

    Args:
        hf_config: the model's transformers config; a vision-language model's language model is
            switched (`get_text_config`), its vision tower keeps its masks.
    """
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if getattr(text, "_attn_implementation", None) != SDPA:
        yield
        return
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    text._attn_implementation = CAUSAL_SDPA
    try:
        yield
    finally:
        text._attn_implementation = SDPA
