"""Model presets: :data:`PRESETS`, tiny models built from a `transformers` config and the bundled
OLMo-2 tokenizer (no download; `models.initialize.init_model` draws their weights and saves them),
and the shapes of real models for the memory planner (config only, built on the meta device).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletune.errors import UserError

if TYPE_CHECKING:  # torch and transformers are imported lazily: `scaletune --help` stays fast
    from transformers import PretrainedConfig

ASSETS = Path(__file__).resolve().parent.parent / "assets"
OLMO2_TOKENIZER = ASSETS / "olmo2-dolma2.json"

# Special tokens of the bundled OLMo-2 (dolma2) tokenizer, as allenai/OLMo-2-1124-7B declares
# them: documents end with <|endoftext|> (id 100257), which also serves as BOS; <|pad|> is 100277.
_OLMO2_EOS_ID = 100257
_OLMO2_PAD_ID = 100277
# OLMo-2 pads its 100,278-token vocabulary to 100,352 (a multiple of 128) for matmul efficiency.
_TINY_VOCAB = 100_352
_TINY_CONTEXT = 2048


@dataclass(frozen=True)
class VisionPreset:
    """The processor of a tiny vision-language preset, built over the bundled tokenizer.

    Attributes:
        processor_class: the `transformers` processor class, by name (`Idefics3Processor`).
        image_processor_class: its image processor class, by name.
        image_processor: the image processor's constructor arguments (small images: tiny models).
        special_tokens: the tokens the processor writes around and for images, added to the
            tokenizer (their ids follow its vocabulary, inside the preset's padded embedding).
        named_tokens: special tokens the processor reads from the tokenizer by name (Gemma 3's
            `boi_token`, `eoi_token`, `image_token`): the tokenizer's `extra_special_tokens`, saved
            in its config, so `tokenizer.boi_token` and `boi_token_id` exist after a reload.
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
    named_tokens: Mapping[str, str] = field(default_factory=dict)


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
# Gemma 3's turn layout, as google/gemma-3-4b-it's chat template writes it ("<start_of_turn>user\n
# <start_of_image>Which digit?<end_of_turn>\n<start_of_turn>model\n7<end_of_turn>\n"; the
# assistant's role is "model"), without its system-prompt folding and its BOS (the bundled tokenizer
# has none); content may also be a plain string. The processor expands <start_of_image> into
# "\n\n<start_of_image>" + image_seq_length soft tokens + "<end_of_image>\n\n".
_GEMMA3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<start_of_image>' }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Tiny Gemma 3: 32x32 images in 8x8 patches (4x4), average-pooled by 2 into 4 soft tokens.
_GEMMA3_TINY_IMAGE = 32


@dataclass(frozen=True)
class Preset:
    """A named model shape.

    Attributes:
        name: the preset's name (`scaletune init-model NAME`).
        config_class: the `transformers` config class, by name (`Olmo2Config`).
        kwargs: its constructor arguments.
        description: one line for listings.
        tiny: True when `models.initialize.init_model` may materialise it with random weights on a CPU;
            False for the shapes of real models, which exist for the planner (meta device only).
        vision: for a vision-language model, the processor `init_model` saves beside it.
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
            "gemma3-tiny",
            "Gemma3Config",
            dict(
                text_config=dict(
                    _tiny(tie_word_embeddings=True, intermediate_size=128, bos_token_id=None),
                    model_type="gemma3_text",
                    head_dim=16,
                    # Gemma 3 interleaves local (sliding-window) and global layers, 5:1; one of each here.
                    sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"],
                ),
                vision_config=dict(
                    model_type="siglip_vision_model",
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    image_size=_GEMMA3_TINY_IMAGE,
                    patch_size=8,
                ),
                mm_tokens_per_image=4,
            ),
            "Gemma 3 architecture (SigLIP vision tower, pooled projector, Gemma 3 language model with a "
            "sliding-window and a global layer; image tokens attend to each other both ways), 2+2 layers, "
            "32x32 images as 4 tokens; its processor beside it",
            vision=VisionPreset(
                processor_class="Gemma3Processor",
                image_processor_class="Gemma3ImageProcessorPil",
                image_processor=dict(size={"height": _GEMMA3_TINY_IMAGE, "width": _GEMMA3_TINY_IMAGE}),
                special_tokens=("<start_of_turn>", "<end_of_turn>"),
                named_tokens={
                    "boi_token": "<start_of_image>",
                    "eoi_token": "<end_of_image>",
                    "image_token": "<image_soft_token>",
                },
                token_ids={
                    "boi_token_index": "<start_of_image>",
                    "eoi_token_index": "<end_of_image>",
                    "image_token_index": "<image_soft_token>",
                },
                end_of_turn="<end_of_turn>",
                processor_kwargs={"image_seq_length": 4},
                chat_template=_GEMMA3_TEMPLATE,
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
