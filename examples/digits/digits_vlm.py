"""Image-to-text on real images, on a CPU: a small vision-language model that captions
scikit-learn's 8x8 handwritten digits ("the digit 7"), trained by scaletune from your own model
and data factories (docs/custom-models.md) with a three-stage curriculum (digits.yaml).

The model mirrors the LLaVA layout: a convolutional image encoder turns an image into 16 patch
features, a projector (two-layer MLP) maps them into the language model's embedding space, and a
causal language model (scaletune's `olmo2-tiny` preset, or any Hugging Face causal LM folder)
reads the 16 image embeddings followed by the caption and predicts the caption's tokens.

    PYTHONPATH=src python -m scaletune train examples/digits/digits.yaml
    PYTHONPATH=src python examples/digits/digits_vlm.py runs/digits/final   # held-out accuracy

The data: 1,797 images of sklearn.datasets.load_digits (no download: scikit-learn ships them), 360
held out (a fixed permutation), the rest for training. A caption is correct when the greedy
decoding equals the reference caption.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CAPTION = "{}"
IMAGE_TOKENS = 1  # the image's embeddings before the caption


class ConvEncoder(nn.Module):
    """[B, 1, 8, 8] pixels in [0, 1] -> [B, 1, 16 * width] image features (a 4 x 4 map, flattened,
    layer-normalised as a CLIP vision tower's output is: what differs between images then dominates
    what they share)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, stride=2, padding=1)
        self.features = 16 * width
        self.norm = nn.LayerNorm(self.features)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv2(F.gelu(self.conv1(pixels - 0.5))))  # [B, width, 4, 4]
        return self.norm(x.flatten(1)).unsqueeze(1)


class Projector(nn.Module):
    """Patch features -> language-model embeddings (LLaVA-1.5's two-layer MLP)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class DigitCaptioner(nn.Module):
    """encoder -> projector -> causal LM. `forward(pixel_values, input_ids, labels)` returns
    (summed cross-entropy over the caption tokens, number of caption tokens): scaletune's contract.

    `shard_modules` names the blocks FSDP2 shards one by one and ZeRO-3 gathers whole.
    """

    def __init__(self, lm: nn.Module, width: int = 16) -> None:
        super().__init__()
        hidden = lm.get_input_embeddings().embedding_dim
        self.encoder = ConvEncoder(width)
        self.projector = Projector(self.encoder.features, hidden)
        self.lm = lm
        self.shard_modules = list(getattr(lm, "_no_split_modules", None) or [])

    def hidden_states(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, 1 + T, hidden]: the decoder over the image embedding and then the caption tokens."""
        image = self.projector(self.encoder(pixel_values))
        text = self.lm.get_input_embeddings()(input_ids)
        inputs = torch.cat([image.to(text.dtype), text], dim=1)
        return self.lm.model(inputs_embeds=inputs, use_cache=False).last_hidden_state

    def forward(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.hidden_states(pixel_values, input_ids)
        # Position IMAGE_TOKENS - 1 + t has seen the image and caption tokens 0..t-1: it predicts token t.
        start = IMAGE_TOKENS - 1
        logits = self.lm.lm_head(hidden[:, start : start + input_ids.size(1)]).float()
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        return loss, (labels != -100).sum()

    @torch.no_grad()
    def caption(self, pixel_values: torch.Tensor, eos_token_id: int, max_new_tokens: int = 3) -> list[list[int]]:
        """Greedy decoding: the caption token ids of each image (without eos)."""
        ids = torch.empty(pixel_values.size(0), 0, dtype=torch.long, device=pixel_values.device)
        for _ in range(max_new_tokens):
            hidden = self.hidden_states(pixel_values, ids)
            ids = torch.cat([ids, self.lm.lm_head(hidden[:, -1]).argmax(-1, keepdim=True)], dim=1)
        out = []
        for row in ids.tolist():
            out.append(row[: row.index(eos_token_id)] if eos_token_id in row else row)
        return out


def tokenizer_for(lm_path: str | None) -> Any:
    """The language model's tokenizer: the folder's, or the OLMo-2 tokenizer bundled with scaletune."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if lm_path:
        return AutoTokenizer.from_pretrained(lm_path)
    from scaletune.models import OLMO2_TOKENIZER

    return PreTrainedTokenizerFast(tokenizer_file=str(OLMO2_TOKENIZER), eos_token="<|endoftext|>", pad_token="<|pad|>")


def build_model(lm_preset: str = "olmo2-tiny", lm_path: str | None = None, width: int = 16) -> tuple:
    """scaletune's model factory: (DigitCaptioner, tokenizer).

    Args:
        lm_preset: a tiny scaletune preset, randomly initialised (the run's seed decides the weights).
        lm_path: a Hugging Face causal LM folder to start from instead (its weights and tokenizer).
        width: channels of the encoder.
    """
    from transformers import AutoModelForCausalLM

    if lm_path:
        lm = AutoModelForCausalLM.from_pretrained(lm_path, dtype=torch.float32)
    else:
        from scaletune.models import get_preset

        lm = AutoModelForCausalLM.from_config(get_preset(lm_preset).config(), dtype=torch.float32)
    return DigitCaptioner(lm, width), tokenizer_for(lm_path)


def digits_split(split: str, holdout: int = 360, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixels [N, 1, 8, 8] in [0, 1], digits [N]) of the train or held-out split (a fixed permutation)."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.RandomState(seed).permutation(len(digits.target))
    idx = order[:holdout] if split == "heldout" else order[holdout:]
    pixels = torch.tensor(digits.images[idx], dtype=torch.float32).unsqueeze(1) / 16.0
    return pixels, torch.tensor(digits.target[idx])


class CaptionedDigits(torch.utils.data.Dataset):
    """Map-style: item i = {pixel_values [1, 8, 8], input_ids: caption token ids + eos}."""

    def __init__(self, split: str, tokenizer: Any, holdout: int = 360) -> None:
        self.pixels, self.digits = digits_split(split, holdout)
        eos = tokenizer.eos_token_id
        self.captions = [tokenizer(CAPTION.format(d))["input_ids"] + [eos] for d in range(10)]

    def __len__(self) -> int:
        return len(self.digits)

    def __getitem__(self, i: int) -> dict:
        return {"pixel_values": self.pixels[i], "input_ids": self.captions[int(self.digits[i])]}


class Collate:
    """Stacks images; pads captions on the right (labels -100 there); every caption token is a target."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad = pad_token_id

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(it["input_ids"]) for it in items)
        ids = torch.full((len(items), longest), self.pad, dtype=torch.long)
        labels = torch.full((len(items), longest), -100, dtype=torch.long)
        for i, it in enumerate(items):
            ids[i, : len(it["input_ids"])] = torch.tensor(it["input_ids"])
            labels[i, : len(it["input_ids"])] = torch.tensor(it["input_ids"])
        return {"pixel_values": torch.stack([it["pixel_values"] for it in items]), "input_ids": ids, "labels": labels}


def build_data(tokenizer: Any, holdout: int = 360) -> tuple:
    """scaletune's data factory: (train set, held-out set, collator); `holdout` images held out."""
    train, heldout = (CaptionedDigits(split, tokenizer, holdout) for split in ("train", "heldout"))
    return train, heldout, Collate(tokenizer.pad_token_id)


def heldout_accuracy(model: DigitCaptioner, tokenizer: Any) -> float:
    """Fraction of the 360 held-out digits whose greedy caption equals the reference caption."""
    pixels, digits = digits_split("heldout")
    model.eval()
    right = 0
    for start in range(0, len(digits), 120):
        for ids, d in zip(
            model.caption(pixels[start : start + 120], tokenizer.eos_token_id), digits[start : start + 120]
        ):
            right += tokenizer.decode(ids) == CAPTION.format(int(d))
    return right / len(digits)


if __name__ == "__main__":
    from scaletune.models.factory import load_custom_model

    model, tok = load_custom_model(sys.argv[1], factory="examples/digits/digits_vlm.py:build_model")
    print(f"held-out accuracy: {heldout_accuracy(model, tok):.4f}")
