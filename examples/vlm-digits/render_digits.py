"""scikit-learn's handwritten digits as image files and chat records, for fine-tuning a
vision-language model on real images (examples/vlm-digits/vlm-digits.yaml, README "Vision-language
models").

    python examples/vlm-digits/render_digits.py data/vlm-digits [--train 1437] [--eval 360]

The data: the 1,797 8x8 images of `sklearn.datasets.load_digits` (UCI's Optical Recognition of
Handwritten Digits, 43 writers; no download: scikit-learn ships them), in a fixed permutation
(seed 0): the first `--eval` held out, the next `--train` for training. Each image is saved as an
8-bit grey PNG (the 0-16 ink levels scaled to 0-255), and each record is a two-turn conversation:

    {"messages": [{"role": "user", "content": [{"type": "image", "path": "images/0042.png"},
                                               {"type": "text", "text": "Which digit is this?"}]},
                  {"role": "assistant", "content": "7"}]}

Writes OUT/images/NNNN.png, OUT/train.jsonl and OUT/eval.jsonl (image paths relative to OUT).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

QUESTION = "Which digit is this?"


def render(out: Path, n_train: int, n_eval: int, seed: int = 0) -> dict[str, Path]:
    """Write the images and the two JSONL files under `out`; returns {"train": path, "eval": path}."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.images))
    held, train = order[:n_eval], order[n_eval : n_eval + n_train]
    (out / "images").mkdir(parents=True, exist_ok=True)
    files = {}
    for name, idx in (("train", train), ("eval", held)):
        lines = []
        for i in idx:
            rel = f"images/{i:04d}.png"
            pixels = (digits.images[i] * (255 / 16)).round().astype("uint8")
            Image.fromarray(pixels, mode="L").save(out / rel)
            user = [{"type": "image", "path": rel}, {"type": "text", "text": QUESTION}]
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": str(digits.target[i])}]
            lines.append(json.dumps({"messages": messages}))
        files[name] = out / f"{name}.jsonl"
        files[name].write_text("\n".join(lines) + "\n")
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--train", type=int, default=1437)
    ap.add_argument("--eval", type=int, default=360)
    args = ap.parse_args()
    for name, path in render(args.out, args.train, args.eval).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
