"""`init_model`: a tiny preset (`models.presets.PRESETS`) materialised as a model folder, its weights
drawn by the architecture's own initialiser, its tokenizer (and a vision-language model's processor)
beside them; and :func:`tokenizer_from_file`, the tokenizer it builds over a `tokenizers` JSON.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletune.errors import UserError
from scaletune.models.presets import OLMO2_TOKENIZER, PRESETS, Preset, get_preset

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A child of the "scaletune" logger, whose handler and rank-aware level (env.set_rank) it follows.
log = logging.getLogger(__name__)

_MARKER = "scaletune_init.json"


def init_model(preset: str, output: str | Path, *, seed: int = 0, tokenizer_file: str | Path | None = None) -> Path:
    """Build a randomly initialised model from a tiny preset and save it with its tokenizer.

    The weights are drawn after `torch.manual_seed(seed)` by the architecture's own initialiser,
    saved as float32 safetensors with `save_pretrained`; the tokenizer (a `PreTrainedTokenizerFast`
    over the bundled OLMo-2 tokenizer, or over `tokenizer_file`) is saved beside it, so the
    folder loads with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`.

    Idempotent: when `output` already holds this preset built with this seed and tokenizer (a
    `scaletune_init.json` marker written last says so), it is returned as is. The folder is built
    under a temporary name and renamed into place, so ranks that call this at the same time
    neither see a half-written model nor fail.

    Args:
        preset: a name in :data:`PRESETS` whose `tiny` is True.
        output: the folder to create (its parent is created too).
        seed: seed of the random initialisation.
        tokenizer_file: a `tokenizers` JSON to use instead of the bundled OLMo-2 one (for example
            the GPT-NeoX tokenizer in ../shared/data); the vocabulary is then sized to it,
            rounded up to a multiple of 128.

    Returns:
        The absolute path of `output`.

    Raises:
        UserError: unknown preset; a planner-only preset (too large to materialise here);
            `output` holds something else (another preset or seed, or files that are not a
            scaletune-built model).
    """
    p = get_preset(preset)
    if not p.tiny:
        tiny = ", ".join(n for n, q in PRESETS.items() if q.tiny)
        raise UserError(
            f"preset {preset!r} is the shape of a real model ({p.description}); init_model builds "
            f"random weights of tiny presets only ({tiny}). Use it with `scaletune plan`, which "
            "needs no weights, or point model.name_or_path at the real checkpoint.",
            title="preset too large",
        )
    out = Path(output).expanduser().resolve()
    tok_path = Path(tokenizer_file).expanduser().resolve() if tokenizer_file else OLMO2_TOKENIZER
    if not tok_path.is_file():
        raise UserError(f"tokenizer file {str(tok_path)!r} does not exist", title="missing tokenizer")
    want = {"preset": p.name, "seed": seed, "tokenizer": tok_path.name}
    if _existing_matches(out, want):
        return out

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    tokenizer = tokenizer_from_file(
        tok_path,
        model_max_length=p.kwargs.get("max_position_embeddings"),
        named_tokens=p.vision.named_tokens if p.vision else None,
    )
    overrides: dict[str, Any] = {}
    processor = None
    if p.vision is not None:
        processor, overrides = _vision_processor(p, tokenizer, sized=bool(tokenizer_file))
    elif tokenizer_file:
        overrides = {
            "vocab_size": -(-len(tokenizer) // 128) * 128,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
        if p.kwargs.get("bos_token_id") is not None:
            overrides["bos_token_id"] = tokenizer.bos_token_id
    config = p.config(**overrides)
    text_config = config.get_text_config()
    if text_config.vocab_size < len(tokenizer):
        raise AssertionError(
            f"preset {p.name}: vocab_size {text_config.vocab_size} < tokenizer length {len(tokenizer)}"
        )

    torch.manual_seed(seed)
    auto = AutoModelForCausalLM if p.vision is None else AutoModelForImageTextToText
    model = auto.from_config(config, dtype=torch.float32)
    n_params = sum(t.numel() for t in model.parameters())

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp)
        (processor or tokenizer).save_pretrained(tmp)  # a processor saves its tokenizer too
        # The marker is written last: its presence means the folder is complete.
        (tmp / _MARKER).write_text(json.dumps({**want, "parameters": n_params}, indent=2) + "\n")
        try:
            if out.is_dir() and not any(out.iterdir()):
                out.rmdir()
            os.rename(tmp, out)
        except OSError:
            # Another process renamed its copy into place first; it is the same model.
            if not _existing_matches(out, want):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(f"built {p.name} (seed {seed}, {n_params:,} parameters) in {out}")
    return out


def _vision_processor(p: Preset, tokenizer: PreTrainedTokenizerBase, *, sized: bool) -> tuple[Any, dict[str, Any]]:
    """The preset's processor over `tokenizer` (its image tokens added, its EOS the end of a turn),
    and the config overrides that name those tokens' ids (the language model's EOS and pad too, and
    with `sized` its vocabulary: the tokenizer's length rounded up to a multiple of 128)."""
    import transformers

    vision = p.vision
    assert vision is not None

    tokenizer.add_special_tokens({"additional_special_tokens": list(vision.special_tokens)})
    tokenizer.eos_token = vision.end_of_turn
    image_processor = getattr(transformers, vision.image_processor_class)(**vision.image_processor)
    processor = getattr(transformers, vision.processor_class)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=vision.chat_template,
        **vision.processor_kwargs,
    )
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in vision.token_ids.items()}
    text = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    if sized:
        text["vocab_size"] = -(-len(tokenizer) // 128) * 128
    return processor, {**ids, "text_config": {**p.kwargs["text_config"], **text}}


def _existing_matches(out: Path, want: dict[str, Any]) -> bool:
    """True when `out` holds the model `want` describes; False when `out` is absent or empty.

    Raises:
        UserError: `out` holds something else.
    """
    if not out.exists():
        return False
    if not out.is_dir():
        raise UserError(f"{out} exists and is not a folder", title="cannot write model")
    marker = out / _MARKER
    if marker.is_file():
        try:
            have = json.loads(marker.read_text())
        except (OSError, ValueError):
            have = {}
        if all(have.get(k) == v for k, v in want.items()):
            if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
                return True
        got = ", ".join(f"{k} {have.get(k)!r}" for k in want)
        asked = ", ".join(f"{k} {v!r}" for k, v in want.items())
        raise UserError(
            f"{out} already holds a different model ({got}); asked for {asked}. "
            "Choose another folder or delete this one.",
            title="cannot write model",
        )
    if any(out.iterdir()):
        raise UserError(
            f"{out} is not empty and was not written by init_model; choose an empty or new folder",
            title="cannot write model",
        )
    return False


def tokenizer_from_file(
    path: Path, *, model_max_length: int | None = None, named_tokens: Mapping[str, str] | None = None
) -> PreTrainedTokenizerBase:
    """A `PreTrainedTokenizerFast` over a `tokenizers` JSON with BOS/EOS/PAD found by name, and
    `named_tokens` (attribute name -> token, added to the vocabulary) as its `extra_special_tokens`.

    EOS is the end-of-document token (`<|endoftext|>`, `</s>`, ...), BOS the same token where
    the vocabulary has no separate one (OLMo and GPT-NeoX do not), PAD a dedicated padding token
    where one exists, else EOS (labels of padding are masked, so the choice does not leak).
    """
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
    vocab = tok.get_vocab()

    def first(*names: str) -> str | None:
        return next((n for n in names if n in vocab), None)

    eos = first("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
    bos = first("<|begin_of_text|>", "<s>", "<bos>") or eos
    pad = first("<|pad|>", "<|padding|>", "<pad>", "<|finetune_right_pad_id|>") or eos
    if eos is None:
        raise UserError(f"tokenizer {path}: no end-of-text token found", title="invalid tokenizer")
    kwargs: dict[str, Any] = {"eos_token": eos, "bos_token": bos, "pad_token": pad}
    if model_max_length:
        kwargs["model_max_length"] = model_max_length
    if named_tokens:
        kwargs["extra_special_tokens"] = dict(named_tokens)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path), **kwargs)
    tok.padding_side = "right"
    return tok
