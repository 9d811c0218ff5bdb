"""Held-out accuracy of a vision-language model on the digits (examples/vlm-digits/vlm-digits.yaml):
the share of images whose greedy answer is the digit.

    python examples/vlm-digits/accuracy.py MODEL_FOLDER data/vlm-digits/eval.jsonl

MODEL_FOLDER is any folder `AutoModelForImageTextToText` and `AutoProcessor` load: a run's `final/`,
an export, or the untrained preset (the "before"). Loaded with transformers alone, as a user of the
folder would; answers are greedy, at most 4 new tokens, cut at the end of the turn.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def accuracy(folder: str, data: Path) -> tuple[float, int]:
    """(the share of records answered with their digit, the number of records)."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    records = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    right = 0
    for start in range(0, len(records), 32):
        chunk = records[start : start + 32]
        prompts = [r["messages"][:1] for r in chunk]
        texts = [processor.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        images = [[Image.open(data.parent / p[0]["content"][0]["path"]).convert("RGB")] for p in prompts]
        processor.tokenizer.padding_side = "left"
        batch = processor(text=texts, images=images, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=4, do_sample=False)
        answers = processor.tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        right += sum(a.strip() == r["messages"][1]["content"] for a, r in zip(answers, chunk))
    return right / len(records), len(records)


if __name__ == "__main__":
    share, n = accuracy(sys.argv[1], Path(sys.argv[2]))
    print(json.dumps({"accuracy": round(share, 4), "records": n}))
