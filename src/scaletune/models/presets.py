"""Model presets and `init_model`.

:data:`PRESETS` / :func:`init_model`: tiny randomly initialised models built from a
`transformers` config and the bundled OLMo-2 tokenizer (no download), and the shapes of real
models for the memory planner (config only, built on the meta device).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletune.errors import UserError

if TYPE_CHECKING:  # torch and transformers are imported lazily: `scaletune --help` stays fast
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

# A child of the "scaletune" logger, whose handler and rank-aware level (env.set_rank) it follows.
log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
OLMO2_TOKENIZER = ASSETS / "olmo2-dolma2.json"

# Special tokens of the bundled OLMo-2 (dolma2) tokenizer, as allenai/OLMo-2-1124-7B declares
# them: documents end with <|endoftext|> (id 100257), which also serves as BOS; <|pad|> is 100277.
_OLMO2_EOS_ID = 100257
_OLMO2_PAD_ID = 100277
# OLMo-2 pads its 100,278-token vocabulary to 100,352 (a multiple of 128) for matmul efficiency.
_TINY_VOCAB = 100_352
_TINY_CONTEXT = 2048
_MARKER = "scaletune_init.json"


@dataclass(frozen=True)
class VisionPreset:
    """The processor of a tiny vision-language preset, built over the bundled tokenizer.

    Attributes:
        processor_class: the `transformers` processor class, by name (`Idefics3Processor`).
        image_processor_class: its image processor class, by name.
        image_processor: the image processor's constructor arguments (small images: tiny models).
        special_tokens: the tokens the processor writes around and for images, added to the
            tokenizer (their ids follow its vocabulary, inside the preset's padded embedding).
        token_ids: config keys set to a special token's id (`image_token_id` -> `<image>`).
        end_of_turn: the token that ends every turn (the tokenizer's EOS, and the config's).
        processor_kwargs: further processor arguments (`image_seq_len`).
        chat_template: the processor's chat template (content parts `{"type": "image"}` and
            `{"type": "text", "text": ...}`).
    """

    processor_class: str
    image_processor_class: str
    image_processor: Mapping[str, Any]
    special_tokens: tuple[str, ...]
    token_ids: Mapping[str, str]
    end_of_turn: str
    processor_kwargs: Mapping[str, Any]
    chat_template: str


# SmolVLM's turn layout ("User:<image>Which digit?<end_of_utterance>\nAssistant: 7<end_of_utterance>\n"),
# as HuggingFaceTB/SmolVLM-256M-Instruct's chat template writes it; content may also be a plain string.
_IDEFICS3_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_utterance>\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# Tiny Idefics3: 32x32 images in 8x8 patches (16), pixel-shuffled by 2 into 4 image tokens.
_IDEFICS3_TINY_IMAGE = 32
# LLaVA-1.5's turn layout ("USER: <image>\nWhich digit?</s>\nASSISTANT: 7</s>\n"; llava-hf's
# template ends a turn with a space, where this one ends it with the EOS token that the chat data's
# turns end with); content may also be a plain string.
_LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}:"
    "{% if message['content'] is string %}{{ ' ' + message['content'] }}"
    "{% else %}{{ ' ' }}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>\n' }}{% endif %}{% endfor %}{% endif %}"
    "{{ '</s>\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# Tiny LLaVA: 32x32 images in 8x8 patches, 16 image tokens (the CLS position dropped: "default").
_LLAVA_TINY_IMAGE = 32


@dataclass(frozen=True)
class Preset:
    """A named model shape.

    Attributes:
        name: the preset's name (`scaletune init-model NAME`).
        config_class: the `transformers` config class, by name (`Olmo2Config`).
        kwargs: its constructor arguments.
        description: one line for listings.
        tiny: True when :func:`init_model` may materialise it with random weights on a CPU;
            False for the shapes of real models, which exist for the planner (meta device only).
        vision: for a vision-language model, the processor :func:`init_model` saves beside it.
    """

    name: str
    config_class: str
    kwargs: Mapping[str, Any]
    description: str
    tiny: bool = True
    #: A vision-language preset's processor (:class:`VisionPreset`); None for a causal LM.
    vision: VisionPreset | None = None

    def config(self, **overrides: Any) -> PretrainedConfig:
        """A fresh `transformers` config of this preset (`overrides` replace constructor args)."""
        import transformers

        cls = getattr(transformers, self.config_class)
        return cls(**{**self.kwargs, **overrides})


def _tiny(**kw: Any) -> dict[str, Any]:
    base = dict(
        vocab_size=_TINY_VOCAB,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as every recent architecture uses
        max_position_embeddings=_TINY_CONTEXT,
        bos_token_id=_OLMO2_EOS_ID,
        eos_token_id=_OLMO2_EOS_ID,
        pad_token_id=_OLMO2_PAD_ID,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return base


_LLAMA3_VOCAB = 128_256
# Shapes from the published config.json of meta-llama/Llama-3.2-1B, Meta-Llama-3-8B and -70B.
_LLAMA3_ROPE = {"rope_type": "default", "rope_theta": 500_000.0}
_LLAMA32_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "olmo2-tiny",
            "Olmo2Config",
            _tiny(bos_token_id=None),  # OLMo-2 prepends no BOS
            "OLMo-2 architecture, 2 layers x 64 hidden, 13.0M parameters (12.8M of them the untied embeddings)",
        ),
        Preset(
            "llama-tiny",
            "LlamaConfig",
            _tiny(),
            "Llama architecture, 2 layers x 64 hidden, 13.0M parameters",
        ),
        Preset(
            "qwen2-tiny",
            "Qwen2Config",
            # Qwen2.5's small models tie the input and output embeddings: one tiny preset that
            # does lets checkpoint and export code meet tied weights.
            _tiny(tie_word_embeddings=True),
            "Qwen2 architecture (q/k/v biases, tied embeddings), 2 layers x 64 hidden, 6.5M parameters",
        ),
        Preset(
            "mistral-tiny",
            "MistralConfig",
            _tiny(sliding_window=None),
            "Mistral architecture, 2 layers x 64 hidden, 13.0M parameters",
        ),
        Preset(
            "gpt-neox-tiny",
            "GPTNeoXConfig",
            {
                k: v
                for k, v in _tiny().items()
                if k != "num_key_value_heads"  # GPT-NeoX has no grouped-query attention
            },
            "GPT-NeoX architecture (fused query_key_value), 2 layers x 64 hidden, 13.0M parameters",
        ),
        Preset(
            "idefics3-tiny",
            "Idefics3Config",
            dict(
                text_config=dict(
                    _tiny(tie_word_embeddings=True, intermediate_size=128), model_type="llama", bos_token_id=None
                ),
                vision_config=dict(
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    image_size=_IDEFICS3_TINY_IMAGE,
                    patch_size=8,
                ),
                scale_factor=2,
                tie_word_embeddings=True,
            ),
            "Idefics3 / SmolVLM architecture (SigLIP vision tower, pixel-shuffle connector, Llama language "
            "model), 2+2 layers, 32x32 images as 4 tokens, 6.5M parameters; its processor beside it",
            vision=VisionPreset(
                processor_class="Idefics3Processor",
                image_processor_class="Idefics3ImageProcessorPil",
                image_processor=dict(
                    do_image_splitting=False,
                    size={"longest_edge": _IDEFICS3_TINY_IMAGE},
                    max_image_size={"longest_edge": _IDEFICS3_TINY_IMAGE},
                ),
                special_tokens=("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"),
                token_ids={"image_token_id": "<image>"},
                end_of_turn="<end_of_utterance>",
                processor_kwargs={"image_seq_len": 4},
                chat_template=_IDEFICS3_TEMPLATE,
            ),
        ),
        Preset(
            "llava-tiny",
            "LlavaConfig",
            dict(
                text_config=dict(_tiny(intermediate_size=128), model_type="llama", bos_token_id=None),
                vision_config=dict(
                    model_type="clip_vision_model",
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    image_size=_LLAVA_TINY_IMAGE,
                    patch_size=8,
                    projection_dim=32,
                ),
                vision_feature_select_strategy="default",
                vision_feature_layer=-1,
                image_seq_length=(_LLAVA_TINY_IMAGE // 8) ** 2,
            ),
            "LLaVA-1.5 architecture (CLIP vision tower, two-layer MLP projector, Llama language model), "
            "2+2 layers, 32x32 images as 16 tokens; its processor beside it",
            vision=VisionPreset(
                processor_class="LlavaProcessor",
                image_processor_class="CLIPImageProcessorPil",
                image_processor=dict(
                    size={"shortest_edge": _LLAVA_TINY_IMAGE},
                    crop_size={"height": _LLAVA_TINY_IMAGE, "width": _LLAVA_TINY_IMAGE},
                ),
                special_tokens=("<image>", "</s>"),
                token_ids={"image_token_id": "<image>"},
                end_of_turn="</s>",
                # CLIP's CLS position is one more than the patches (dropped again by "default").
                processor_kwargs={
                    "patch_size": 8,
                    "vision_feature_select_strategy": "default",
                    "num_additional_image_tokens": 1,
                },
                chat_template=_LLAVA_TEMPLATE,
            ),
        ),
        Preset(
            "llama-3.2-1b",
            "LlamaConfig",
            dict(
                vocab_size=_LLAMA3_VOCAB,
                hidden_size=2048,
                intermediate_size=8192,
                num_hidden_layers=16,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=64,
                max_position_embeddings=131_072,
                rope_parameters=_LLAMA32_ROPE,
                rms_norm_eps=1e-5,
                tie_word_embeddings=True,
                bos_token_id=128_000,
                eos_token_id=128_001,
            ),
            "shape of Llama-3.2-1B (1.24B parameters; planner only)",
            tiny=False,
        ),
        Preset(
            "llama-3-8b",
            "LlamaConfig",
            dict(
                vocab_size=_LLAMA3_VOCAB,
                hidden_size=4096,
                intermediate_size=14_336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                max_position_embeddings=8192,
                rope_parameters=_LLAMA3_ROPE,
                rms_norm_eps=1e-5,
                bos_token_id=128_000,
                eos_token_id=128_001,
            ),
            "shape of Meta-Llama-3-8B (8.03B parameters; planner only)",
            tiny=False,
        ),
        Preset(
            "llama-3-70b",
            "LlamaConfig",
            dict(
                vocab_size=_LLAMA3_VOCAB,
                hidden_size=8192,
                intermediate_size=28_672,
                num_hidden_layers=80,
                num_attention_heads=64,
                num_key_value_heads=8,
                max_position_embeddings=8192,
                rope_parameters=_LLAMA3_ROPE,
                rms_norm_eps=1e-5,
                bos_token_id=128_000,
                eos_token_id=128_001,
            ),
            "shape of Meta-Llama-3-70B (70.6B parameters; planner only)",
            tiny=False,
        ),
    ]
}


def get_preset(name: str) -> Preset:
    """The preset called `name`.

    Raises:
        UserError: no such preset; the message lists them all.
    """
    from scaletune.models.pretrained import PRETRAINED

    try:
        return PRESETS[name]
    except KeyError:
        listing = "; ".join(f"{p.name} ({p.description})" for p in [*PRETRAINED.values(), *PRESETS.values()])
        raise UserError(f"unknown model preset {name!r}; presets: {listing}", title="unknown preset") from None


def preset_config(name: str) -> PretrainedConfig:
    """The `transformers` config of a preset (for the planner: no weights involved)."""
    return get_preset(name).config()


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

    tokenizer = tokenizer_from_file(tok_path, model_max_length=p.kwargs.get("max_position_embeddings"))
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


def tokenizer_from_file(path: Path, *, model_max_length: int | None = None) -> PreTrainedTokenizerBase:
    """A `PreTrainedTokenizerFast` over a `tokenizers` JSON with BOS/EOS/PAD found by name.

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
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path), **kwargs)
    tok.padding_side = "right"
    return tok
