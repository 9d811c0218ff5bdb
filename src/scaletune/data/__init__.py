"""Data: sources, templates and tokenisation, packing, batching and samplers.

* :mod:`.sources`: reading and checking records, the train/eval split.
* :mod:`.templates`: prompt formats, chat templates, the encoder.
* :mod:`.packing`: packing rows, and the attention implementations that keep packs apart.
* :mod:`.build`: :func:`~.build.build_datasets` (read, split, tokenize, pack, cache).
* :mod:`.batching`: the :class:`~.batching.Collator`, token counts, samplers and loaders.
* :mod:`.factory`: your own data (`data.factory`): data sets and collator, unit counts.

Every row this package produces has three integer columns of equal length:

- ``input_ids``: token ids.
- ``labels``: Hugging Face convention, *unshifted*: ``labels[i] == input_ids[i]`` where token ``i``
  is trained and ``-100`` where it is not; the loss shifts (logits at ``i`` predict ``labels[i+1]``).
  The first token of every example is always ``-100``: nothing before it can predict it, so this
  changes no loss, makes ``(labels != -100).sum()`` the exact number of predicted tokens, and lets
  packing be plain concatenation (no prediction crosses from one example into the next).
- ``position_ids``: ``0, 1, 2, ...`` restarting at 0 at the start of every example.

Formats (``DataSource.format``):

- ``alpaca``: ``instruction``, ``input`` (optional), ``output``. The prompt is the Stanford Alpaca
  prompt (:data:`ALPACA_PROMPT`, :data:`ALPACA_PROMPT_NO_INPUT`), untrained; the target is
  ``output`` followed by the tokenizer's eos token. Prompt and target are tokenized separately, as
  at inference the prompt is tokenized alone. With ``DataSource.template: chat`` the record is a user
  turn (instruction, blank line, input) and an assistant turn (output) rendered and masked as
  ``messages`` (:func:`alpaca_messages`).
- ``messages``: a list of ``{role, content}`` (roles system, user, assistant) rendered with a chat
  template: ``data.chat_template`` if given, else the tokenizer's own, else :data:`CHATML_TEMPLATE`.
  Only the content of assistant turns and the template's end-of-turn text after it (``<|im_end|>``
  for ChatML) are trained.
- ``text``: the field ``text`` (or ``DataSource.field``), all of it trained, eos appended.

Packing and attention: see :class:`Collator`.
"""

import importlib
from typing import Any

# Each public name and the module that defines it. The package imports them on first use (PEP 562):
# batching imports torch and build imports datasets (3 s of CPU together), which reading and
# checking records (`validate_data`, before a config typo is answered) does not need.
_EXPORTS = {
    "batching": (
        "Collator",
        "ResumableSampler",
        "count_input_tokens",
        "count_target_tokens",
        "global_batches",
        "make_eval_loader",
        "make_loader",
    ),
    "build": ("DataBundle", "build_datasets", "cache_root"),
    "factory": ("build_custom_data", "count_batch_tokens", "count_units", "custom_inputs"),
    "packing": ("check_packing_support", "pack_rows"),
    "sources": ("IGNORE_INDEX", "ROLES", "load_records", "split_records", "validate_data"),
    "templates": (
        "ALPACA_PROMPT",
        "ALPACA_PROMPT_NO_INPUT",
        "CHATML_TEMPLATE",
        "Encoder",
        "alpaca_messages",
        "alpaca_prompt",
        "render_chat",
        "resolve_chat_template",
        "tokenizer_fingerprint",
        "trained_chat_template",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
