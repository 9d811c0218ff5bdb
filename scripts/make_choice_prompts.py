"""Build the GRPO example's prompts (examples/grpo.yaml) from the Stanford Alpaca records in
../shared/data/alpaca_5000.json (the 5,000-record subset whose first 400 are
examples/data/alpaca_400.json): a verifiable task, the Alpaca questions whose answer is one of the
options the question names ("Categorize the following fruit as either a citrus or a non-citrus
fruit. Banana" -> "Non-citrus fruit").

A record takes part when its output is at most MAX_ANSWER_WORDS words, the normalised output
(`scaletune.rewards.builtin.normalise`: case, spacing, surrounding quotes and punctuation) occurs in
its instruction and input and is not their beginning, and the instruction and input together are at
most MAX_PROMPT_CHARS characters. The prompt is the instruction, the input after a blank line, and
"Reply with the answer only." on its own line; `answer` is the output without a final period,
checked by `scaletune.rewards:exact_answer`; `alpaca_index` is the record's place in the source.
Every fourth record (0, 4, 8, ...) is held out (examples/data/choice_heldout.jsonl), the rest train
(examples/data/choice_train.jsonl).

Deterministic (no randomness). Run from the repository root:

    python scripts/make_choice_prompts.py [--source ../shared/data/alpaca_5000.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scaletune.rewards.builtin import normalise

OUT = Path("examples/data")
INSTRUCTION = "Reply with the answer only."
MAX_ANSWER_WORDS = 3
MAX_PROMPT_CHARS = 240


def choice_prompts(records: list[dict]) -> list[dict]:
    """The records that are a choice among options their prompt names, as prompt records."""
    out = []
    for index, r in enumerate(records):
        answer = r["output"].strip()
        if len(answer.split()) > MAX_ANSWER_WORDS or len(r["instruction"]) + len(r["input"]) > MAX_PROMPT_CHARS:
            continue
        key = normalise(answer)
        if not isinstance(key, str) or len(key) < 2:  # numbers are computed, not chosen
            continue
        asked = (r["instruction"] + " " + r["input"]).casefold()
        if key not in asked or asked.strip().startswith(key):
            continue
        text = r["instruction"].strip() + ("\n\n" + r["input"].strip() if r["input"].strip() else "")
        out.append({"prompt": f"{text}\n{INSTRUCTION}", "answer": answer.rstrip("."), "alpaca_index": index})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="../shared/data/alpaca_5000.json")
    args = parser.parse_args()
    prompts = choice_prompts(json.loads(Path(args.source).read_text()))
    parts = {
        "choice_train.jsonl": [p for k, p in enumerate(prompts) if k % 4],
        "choice_heldout.jsonl": prompts[::4],
    }
    for name, lines in parts.items():
        (OUT / name).write_text("".join(json.dumps(p) + "\n" for p in lines))
        print(f"{OUT / name}: {len(lines)} prompts")


if __name__ == "__main__":
    main()
