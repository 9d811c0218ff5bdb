"""Build the tests' tokenizer, tests/assets/olmo2-alpaca.json: OLMo-2's tokenizer cut down to the tokens the
project's data uses.

The tiny presets with OLMo-2's 100,352-token vocabulary are 98.5 % embeddings (13.0M of 13.2M
parameters; 149 MB a checkpoint). This keeps OLMo-2's BPE (its pre-tokenizer, decoder, special
tokens and the order of its merges) but only the tokens that encoding the project's text produces,
with every merge that builds them and the 256 byte-level symbols; ids are renumbered in OLMo-2's
order. BPE applies, at each step, the earliest merge among the adjacent pairs present, so a merge
that never fires on a text can be dropped without changing how that text is cut: on this text the
cut tokenizer produces exactly OLMo-2's tokens (checked below), so row lengths, truncation and
packing in the tests are OLMo-2's; other text still encodes (into more, shorter tokens).

The text: every string of ../shared/data/alpaca_5000.json (Stanford Alpaca, 5,000 records,
github.com/tatsu-lab/stanford_alpaca, CC BY-NC 4.0) and of examples/data/*.json[l] (the project's
own shipped data, derived from the same records), each record also rendered through the Alpaca
prompt and the built-in ChatML template as training renders it.

Usage: python scripts/make_test_tokenizer.py [--check]   (--check: the shipped file is what this builds)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "scaletune" / "assets" / "olmo2-dolma2.json"
OUT = ROOT / "tests" / "assets" / "olmo2-alpaca.json"
DATA = [ROOT.parent / "shared" / "data" / "alpaca_5000.json", *sorted((ROOT / "examples" / "data").glob("*.json*"))]


def _records(path: Path) -> list:
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    return data if isinstance(data, list) else [data]


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def corpus() -> list[str]:
    sys.path.insert(0, str(ROOT / "src"))
    from scaletune.data.templates import alpaca_prompt

    texts: list[str] = []
    for path in DATA:
        for record in _records(path):
            texts += _strings(record)
            if isinstance(record, dict) and "instruction" in record:
                prompt = alpaca_prompt(record["instruction"], record.get("input") or "")
                answer = str(record.get("output", ""))
                texts.append(prompt + answer + "<|endoftext|>")
                user = record["instruction"] + ("\n\n" + record["input"] if record.get("input") else "")
                texts.append(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n")
    return texts


def build() -> str:
    from tokenizers import Tokenizer

    full = Tokenizer.from_file(str(SOURCE))
    spec = json.loads(SOURCE.read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    made_by = {a + b: (a, b) for a, b in merges}
    texts = corpus()
    keep = {t for t in vocab if len(t) == 1}  # the byte-level alphabet (every single symbol)
    todo = [t for text in texts for t in full.encode(text).tokens]
    while todo:
        token = todo.pop()
        if token in keep or token not in vocab:
            continue  # added (special) tokens are not in the BPE vocabulary; they are kept below
        keep.add(token)
        todo.extend(made_by.get(token, ()))
    kept = sorted(keep, key=vocab.__getitem__)
    new_ids = {t: i for i, t in enumerate(kept)}
    spec["model"]["vocab"] = new_ids
    spec["model"]["merges"] = [[a, b] for a, b in merges if a + b in new_ids and a in new_ids and b in new_ids]
    for n, added in enumerate(spec["added_tokens"]):
        added["id"] = len(kept) + n
    text = json.dumps(spec, ensure_ascii=False, indent=1) + "\n"
    cut = Tokenizer.from_str(text)
    for t in texts:  # the claim above, on every text it was built from
        assert cut.encode(t).tokens == full.encode(t).tokens, t[:200]
    return text


def main() -> int:
    text = build()
    if sys.argv[1:] == ["--check"]:
        same = OUT.is_file() and OUT.read_text() == text
        print(f"{OUT}: {'matches' if same else 'DIFFERS from'} what this script builds")
        return 0 if same else 1
    OUT.write_text(text)
    from tokenizers import Tokenizer

    print(f"wrote {OUT} ({Tokenizer.from_str(text).get_vocab_size()} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
