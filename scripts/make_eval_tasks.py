"""Build scaletune's shipped lm-evaluation-harness task data (src/scaletune/assets/eval_tasks/)
from the Stanford Alpaca records in ../shared/data/alpaca_5000.json.

alpaca_mc.jsonl: multiple choice. Each item is a record's instruction (and input) as the context
and four candidate responses: the record's own output and the outputs of three other records,
drawn with a fixed seed and shuffled; `label` is the index of the record's own output. Only
records whose output is at most MAX_CHARS characters take part (items stay cheap to score on a
CPU), and distractors are drawn from the same pool, so length alone rarely gives the answer away.
Records the shipped examples train on (examples/data/*.json, the quickstart's included) are left
out of the pool, by instruction and input and by output: an example's run is not scored on what it
trained on, neither as a question nor as a distractor.

Deterministic: the same input file gives the same bytes (seed SEED). Run from the repository root:

    python scripts/make_eval_tasks.py [--source ../shared/data/alpaca_5000.json] [--items 150]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "src" / "scaletune" / "assets" / "eval_tasks"
SEED = 20261125
MAX_CHARS = 160
CHOICES = 4


def context(rec: dict) -> str:
    """The question as the model sees it; the harness appends `target_delimiter` (" ") and a choice."""
    text = f"Instruction: {rec['instruction'].strip()}\n"
    if rec.get("input", "").strip():
        text += f"Input: {rec['input'].strip()}\n"
    return text + "Response:"


def trained_on() -> tuple[set[tuple[str, str]], set[str]]:
    """(instruction, input) pairs and outputs of every record the shipped examples train on."""
    questions, outputs = set(), set()
    for path in sorted((ROOT / "examples" / "data").glob("*.json")):
        for r in json.loads(path.read_text()):
            if isinstance(r, dict) and "instruction" in r:
                questions.add((r["instruction"].strip(), r.get("input", "").strip()))
                outputs.add(r.get("output", "").strip())
    return questions, outputs


def build(records: list[dict], n_items: int) -> list[dict]:
    rng = random.Random(SEED)
    questions, outputs = trained_on()
    pool = [
        i
        for i, r in enumerate(records)
        if 0 < len(r["output"].strip()) <= MAX_CHARS
        and "\n" not in r["output"].strip()
        and (r["instruction"].strip(), r.get("input", "").strip()) not in questions
        and r["output"].strip() not in outputs
    ]
    picked = rng.sample(pool, n_items)
    items = []
    for i in picked:
        own = records[i]["output"].strip()
        distractors: list[str] = []
        while len(distractors) < CHOICES - 1:
            other = records[rng.choice(pool)]["output"].strip()
            if other != own and other not in distractors:
                distractors.append(other)
        choices = [own, *distractors]
        rng.shuffle(choices)
        items.append(
            {
                "id": f"alpaca_5000[{i}]",
                "context": context(records[i]),
                "choices": choices,
                "label": choices.index(own),
            }
        )
    return items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=ROOT.parent / "shared" / "data" / "alpaca_5000.json")
    ap.add_argument("--items", type=int, default=150)
    args = ap.parse_args()
    raw = args.source.read_bytes()
    items = build(json.loads(raw), args.items)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "alpaca_mc.jsonl"
    path.write_text("".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items))
    print(f"{len(items)} items -> {path} (source sha256 {hashlib.sha256(raw).hexdigest()[:16]}, seed {SEED})")


if __name__ == "__main__":
    main()
