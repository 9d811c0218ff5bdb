"""Build the DPO example's preference pairs (examples/dpo.yaml) from the bundled Stanford Alpaca
records in examples/data/alpaca_400.json.

Each pair is one record: `prompt` is its instruction, then its input after a blank line (as
`scaletune.data.templates.alpaca_messages` joins them for chat training); `chosen` is the record's
own output; `rejected` is the output of another record of the same split, a real answer to a
different question. The rejected outputs are a seeded random derangement of the split's own outputs,
so every output of a split is chosen once and rejected once: neither an answer's text nor its length
alone tells chosen from rejected, only whether it answers the prompt.

Only records whose prompt is at most MAX_PROMPT_CHARS and whose output is 1..MAX_OUTPUT_CHARS
characters take part, so a prompt with either answer, rendered through SmolLM2's chat template
(about 30 tokens of its own), stays within the example's 256-token max_seq_length (about 4
characters a token; the longest rendered pair is printed). Records are unique by prompt and by
output in the source; the held-out pairs use records disjoint from the training pairs (prompts,
chosen and rejected answers alike), drawn by the same seeded shuffle.

Deterministic: the same source gives the same bytes (seed SEED). Run from the repository root:

    python scripts/make_preference_pairs.py [--train 256] [--heldout 64] [--check-tokens MODEL_DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "examples" / "data" / "alpaca_400.json"
TRAIN_OUT = ROOT / "examples" / "data" / "alpaca_pairs.jsonl"
HELDOUT_OUT = ROOT / "examples" / "data" / "alpaca_pairs_heldout.jsonl"
SEED = 20261126
MAX_PROMPT_CHARS = 300
MAX_OUTPUT_CHARS = 500


def prompt_of(rec: dict) -> str:
    """The user turn, joined as `alpaca_messages` joins instruction and input."""
    return f"{rec['instruction']}\n\n{rec['input']}" if rec.get("input") else rec["instruction"]


def eligible(records: list[dict]) -> list[int]:
    """Indices of the records short enough to take part, each prompt and output seen once only
    (a repeated text could otherwise sit in both splits)."""
    seen_prompts: set[str] = set()
    seen_outputs: set[str] = set()
    keep = []
    for i, r in enumerate(records):
        p, o = prompt_of(r), r["output"]
        if len(p) <= MAX_PROMPT_CHARS and 0 < len(o) <= MAX_OUTPUT_CHARS:
            if p not in seen_prompts and o not in seen_outputs:
                keep.append(i)
        seen_prompts.add(p)
        seen_outputs.add(o)
    return keep


def derange(n: int, rng: random.Random) -> list[int]:
    """A random permutation of range(n) with no fixed point: one seeded shuffle read as a cycle
    (each position points to the next one in shuffled order), so no record gets its own answer."""
    order = list(range(n))
    rng.shuffle(order)
    target = [0] * n
    for k, i in enumerate(order):
        target[i] = order[(k + 1) % n]
    return target


def pairs_of(records: list[dict], indices: list[int], rng: random.Random) -> list[dict]:
    other = derange(len(indices), rng)
    out = []
    for k, i in enumerate(indices):
        chosen, rejected = records[i]["output"], records[indices[other[k]]]["output"]
        if chosen == rejected:  # cannot happen with unique outputs; kept as the brief's rule
            continue
        out.append({"prompt": prompt_of(records[i]), "chosen": chosen, "rejected": rejected})
    return out


def build(records: list[dict], n_train: int, n_heldout: int) -> tuple[list[dict], list[dict]]:
    """(train pairs, held-out pairs).

    Raises:
        SystemExit: fewer eligible records than n_train + n_heldout.
    """
    rng = random.Random(SEED)
    pool = eligible(records)
    if len(pool) < n_train + n_heldout:
        raise SystemExit(f"only {len(pool)} eligible records, {n_train} + {n_heldout} asked for")
    rng.shuffle(pool)
    heldout, train = pool[:n_heldout], pool[n_heldout : n_heldout + n_train]
    # The source's order within each split, so the files read like the data set.
    return pairs_of(records, sorted(train), rng), pairs_of(records, sorted(heldout), rng)


def longest_tokens(model_dir: str, pairs: list[dict]) -> int:
    """The longest prompt + answer in tokens, rendered with the model's own chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    longest = 0
    for p in pairs:
        for answer in (p["chosen"], p["rejected"]):
            turns = [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": answer}]
            text = tok.apply_chat_template(turns, tokenize=False)
            longest = max(longest, len(tok(text, add_special_tokens=False)["input_ids"]))
    return longest


def write(path: Path, pairs: list[dict]) -> None:
    path.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=SOURCE)
    ap.add_argument("--train", type=int, default=256, help="training pairs (default 256)")
    ap.add_argument("--heldout", type=int, default=64, help="held-out pairs (default 64)")
    ap.add_argument("--train-out", type=Path, default=TRAIN_OUT)
    ap.add_argument("--heldout-out", type=Path, default=HELDOUT_OUT)
    ap.add_argument(
        "--check-tokens",
        metavar="MODEL_DIR",
        help="a model folder (e.g. ~/.cache/scaletune/models/smollm2-135m-instruct) whose tokenizer and "
        "chat template measure the longest rendered prompt + answer",
    )
    args = ap.parse_args()
    raw = args.source.read_bytes()
    train, heldout = build(json.loads(raw), args.train, args.heldout)
    write(args.train_out, train)
    write(args.heldout_out, heldout)
    print(
        f"{len(train)} train pairs -> {args.train_out}, {len(heldout)} held-out pairs -> {args.heldout_out} "
        f"(source sha256 {hashlib.sha256(raw).hexdigest()[:16]}, seed {SEED})"
    )
    if args.check_tokens:
        print(f"longest rendered prompt + answer: {longest_tokens(args.check_tokens, train + heldout)} tokens")


if __name__ == "__main__":
    main()
