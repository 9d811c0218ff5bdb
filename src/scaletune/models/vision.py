"""Vision-language models (issue 37): which Hugging Face architectures scaletune fine-tunes with
images in the chat data, how it loads them (`AutoModelForImageTextToText` with its `AutoProcessor`),
and their parts, read from the model itself rather than from tables per architecture.

A config is a vision-language model's when it has a `vision_config` (transformers' composite
configs: `Idefics3Config`, `Qwen2VLConfig`, `LlavaConfig`, `Gemma3Config`, ...). The processor renders
a record's messages and images into `input_ids` and the image tensors its model's forward takes
(`pixel_values` and, by architecture, `pixel_attention_mask`, `image_grid_thw`, `image_sizes`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scaletune.errors import UserError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from scaletune.config import ModelConfig

#: The `model_type`s fine-tuned with images, those proven here (tests/e2e/test_vision.py): an
#: image-text-to-text class whose forward takes the processor's image tensors beside `input_ids` and
#: whose base model's last hidden state feeds `lm_head` (the loss runs the base model, then the head
#: in chunks: `models.loss`). Not yet: Qwen2-VL / Qwen2.5-VL and SmolVLM (their processors need
#: torchvision in transformers 5.24, for their video processors).
VISION_MODEL_TYPES = ("gemma3", "idefics3", "llava")

#: The keys of a processor's output that go to the model's forward beside the text's, one entry per
#: image along their first dimension.
IMAGE_INPUTS = ("pixel_values", "pixel_attention_mask", "image_grid_thw", "image_sizes")

#: The keys of a processor's output with one value per token, [B, T] like `input_ids`: Gemma 3's
#: `token_type_ids` (1 on an image's soft tokens, which attend to each other both ways: transformers'
#: `create_masks_for_vision_model`). Cut and padded (with 0) as the row's tokens are.
TOKEN_INPUTS = ("token_type_ids",)


def is_vision_language(config: PretrainedConfig | None) -> bool:
    """True for a composite config with a vision tower (`vision_config`)."""
    return config is not None and getattr(config, "vision_config", None) is not None


def vision_problem(config: PretrainedConfig, key: str = "model.name_or_path") -> str | None:
    """Why a vision-language config cannot be fine-tuned here (its `model_type` is not among
    :data:`VISION_MODEL_TYPES`), or None."""
    kind = getattr(config, "model_type", "?")
    if kind in VISION_MODEL_TYPES:
        return None
    return (
        f"{key}: {kind!r} is a vision-language model scaletune does not fine-tune; "
        f"it fine-tunes {', '.join(VISION_MODEL_TYPES)}"
    )


def load_processor(cfg: ModelConfig) -> Any:
    """The model's processor (`AutoProcessor.from_pretrained`, no custom code unless
    `model.trust_remote_code`), its tokenizer padding on the right with a pad token, as
    `models.load_tokenizer` sets a text model's.

    Raises:
        UserError: the folder has no processor (a vision-language model saved without one), or the
            processor cannot be built here (`transformers` refuses it; for example Qwen2-VL's needs
            torchvision for its video processor).
    """
    from transformers import AutoProcessor

    name = cfg.tokenizer or cfg.name_or_path
    try:
        processor = AutoProcessor.from_pretrained(
            name, trust_remote_code=bool(cfg.trust_remote_code), revision=cfg.revision
        )
    except (OSError, ValueError, TypeError, ImportError, AttributeError) as exc:
        raise UserError(
            f"model.name_or_path {name!r}: cannot load its processor (a vision-language model needs one "
            f"beside its weights: processor_config.json or preprocessor_config.json): {exc}",
            title="invalid model",
        ) from exc
    tok = getattr(processor, "tokenizer", None)
    if tok is None or not hasattr(processor, "image_processor"):
        raise UserError(
            f"model.name_or_path {name!r}: its processor ({type(processor).__name__}) has no tokenizer "
            "and image processor",
            title="invalid model",
        )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return processor


def multimodal_base(model: Any) -> Any:
    """The base model (`base_model_prefix`: `model`) whose forward merges the image features into
    the text's embeddings and returns the language model's last hidden state."""
    return getattr(model, model.base_model_prefix)


#: The named parameter groups of a vision-language model, for `stages[].trainable` / `frozen`.
GROUPS = ("vision", "projector", "language")


def parameter_groups(model: Any) -> dict[str, list[str]]:
    """The glob patterns (over `model.named_parameters()`' names, peft's under LoRA) of each group of
    :data:`GROUPS`, found by module identity rather than by name: `language` is transformers'
    `get_decoder()` and the output head, `vision` the base model's child whose config is the
    model's `vision_config`, `projector` its other children (Idefics3's `connector`, LLaVA's
    `multi_modal_projector`). Empty for a model that is not a vision-language model. Works on the
    meta device."""
    from scaletune.models.introspection import unwrap

    base = unwrap(model)
    config = getattr(base, "config", None)
    if not is_vision_language(config):
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    language = base.get_decoder()
    groups: dict[str, list[str]] = {g: [] for g in GROUPS}
    for child in multimodal_base(base).children():
        if child is language:
            kind = "language"
        elif getattr(child, "config", None) is config.vision_config:
            kind = "vision"
        else:
            kind = "projector"
        groups[kind].append(f"{names[id(child)]}.*")
    head = base.get_output_embeddings()
    if head is not None:
        groups["language"].append(f"{names[id(head)]}.*")
    return groups
