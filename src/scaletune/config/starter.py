"""`scaletune config new DATA`: a first config for your own data file, its format detected from
the keys of its records. A pure builder: it reads nothing and writes nothing (the verb does both).

The config is the quickstart's recipe (LoRA r=16 on SmolLM2-135M-Instruct, on the CPU), with a held-out
eval split, the objective the format trains with, and comments that say what to change first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

#: Each format and the keys that identify it (every one present), the most specific first.
SIGNATURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("preference", ("prompt", "chosen", "rejected")),
    ("kto", ("prompt", "completion", "label")),
    ("prompt", ("prompt",)),  # after the two above, whose records also have a prompt
    ("messages", ("messages",)),
    ("alpaca", ("instruction", "output")),
    ("text", ("text",)),
)


def detect_format(record: Any) -> str | None:
    """The data format whose keys a record has (:data:`SIGNATURES`), or None."""
    if not isinstance(record, Mapping):
        return None
    for fmt, keys in SIGNATURES:
        if all(k in record for k in keys):
            return fmt
    return None


def starter_config(
    data_path: str, fmt: str, records: int, *, model: str = "smollm2-135m-instruct", name: str = "config.yaml"
) -> str:
    """The YAML text of a first run on `data_path` (`records` records of format `fmt`), to be saved
    as `name` (which its comments name).

    The eval split holds out about 10 % of the records (at least 1, at most 200); preference and
    KTO data train with DPO and KTO on a LoRA adapter (its base is the free reference model), prompt
    data with GRPO rewarded by `exact_answer` (each record's `answer`).
    """
    objective = {"preference": "dpo", "kto": "kto", "prompt": "grpo"}.get(fmt, "sft")
    held_out = min(200, max(1, round(records * 0.1)))
    fraction = round(held_out / records, 4) if records > 1 else None
    data: dict[str, Any] = {"train": {"path": data_path, "format": fmt}}
    if fmt == "alpaca":
        data["train"]["template"] = "chat"  # rendered as the instruct model's own chat turns
    if fraction is not None and records - held_out >= 8:
        data["eval_fraction"] = fraction
    data["max_seq_length"] = 512
    training: dict[str, Any] = {
        "global_batch_size": 8,
        "micro_batch_size": 8 if objective == "sft" else 4,
        "epochs": 3,
        "learning_rate": 2.0e-3 if objective == "sft" else 5.0e-5,
        "lr_scheduler": "cosine",
        "warmup_steps": 3,
        "eval_on_start": "eval_fraction" in data,
        "save_every": 0,
        "log_every": 1,
    }
    if objective != "sft":
        training["objective"] = objective
    if objective == "grpo":  # 8 prompts a step, 4 completions each, scored against each record's `answer`
        training["micro_batch_size"] = 2
        training["rl"] = {
            "num_generations": 4,
            "max_new_tokens": 128,
            "rewards": [{"function": "scaletune.rewards:exact_answer"}],
        }
    config = {
        "output_dir": "runs/my-run",
        "seed": 42,
        "model": {
            "name_or_path": model,
            "dtype": "float32",
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "auto"},
        },
        "data": data,
        "training": training,
        "distributed": {"strategy": "single", "num_processes": 1},
    }
    header = (
        f"# A first run on {data_path}: {records} records of format `{fmt}` (detected from their keys),\n"
        f"# trained with objective `{objective}` as a LoRA adapter on {model}, on the CPU.\n"
        f"# Before training: `scaletune train {name} --check` runs every check (data tokenised included).\n"
        "# What to change first:\n"
        "# - training.epochs: a persona or a style takes a few; facts take many more (docs/own-data.md).\n"
        "# - training.sample_prompts: 2-3 questions that are NOT in your data, answered before and after.\n"
        "# - data.max_seq_length: the `--check` line says how many examples it truncates.\n"
        "# Every key: docs/config.md (`scaletune config reference`).\n"
    )
    return header + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
