"""The model card (README.md) every `scaletune export` writes beside the weights: what the model
was trained from, on what, for how long, how it scored, what it answers and how to load it.

A card travels with the files to other machines and people, so it names folders and files by
their own names, never by an absolute path on this machine. What the run does not record (a data
file's licence, say) is said to be missing, not guessed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from scaletune.config import Config
from scaletune.report import json_lines
from scaletune.resolve import resolve_stages

Kind = Literal["model", "adapter", "gguf"]


def shown(name: str) -> str:
    """A model, tokenizer or data path as a card shows it: a hub id as it is, a local path by its name."""
    p = Path(name).expanduser()
    if not (name.startswith(("/", ".", "~")) or p.exists()):
        return name
    return f"{p.name} (a local {'file' if p.is_file() else 'folder'})"


def base_licence(name: str) -> str:
    """The base model's licence: a pretrained preset's, or the `license:` of a local folder's own
    model card (its YAML front matter); else a sentence saying where to find it."""
    from scaletune.models.pretrained import PRETRAINED

    if name in PRETRAINED:
        return PRETRAINED[name].licence
    folder = Path(name).expanduser()
    readme = folder / "README.md"
    if readme.is_file():
        found = re.search(r"^license:\s*(\S+)\s*$", _front_matter(readme.read_text(errors="replace")), re.MULTILINE)
        if found:
            return found.group(1)
        return "not stated in the base model folder's README.md"
    if folder.is_dir():
        return "not stated: the base model's folder has no README.md"
    return "see the base model's own card"


def data_licence(path: str) -> str:
    """A data file's licence as the README.md beside it states it, in a table row that names the
    file in its first column and the licence in its last (as examples/data/README.md does); else
    a sentence saying it is not recorded."""
    p = Path(path).expanduser()
    readme = p.parent / "README.md"
    if p.is_file() and readme.is_file():
        for line in readme.read_text(errors="replace").splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 2 and cells[0].strip("`") == p.name:
                return cells[-1]
    return "not recorded with the data: state it here before sharing"


def checkpoint_source(checkpoint: Path) -> tuple[str, Path | None]:
    """(how a card names an exported checkpoint, the run directory it is in or None)."""
    source = checkpoint.resolve()
    run_dir = source.parent.parent if source.parent.name == "checkpoints" else None
    where = f" of the run `{run_dir.name}`" if run_dir is not None else ""
    return f"Exported by `scaletune export` from the checkpoint `{source.name}`{where}", run_dir


def model_card(
    cfg: Config,
    *,
    source: str,
    run_dir: Path | None,
    step: int,
    kind: Kind,
    folder: str,
    files: str = "",
    merged: bool = False,
) -> str:
    """The card's Markdown, front matter (Hugging Face's model card metadata) first.

    Args:
        cfg: the run's config (the checkpoint's `config.yaml`).
        source: where the weights come from, one sentence without its full stop
            (:func:`checkpoint_source`, or the run's own `final/`).
        run_dir: the run directory whose metrics.jsonl and samples.jsonl the card reads; None
            for a checkpoint that stands alone.
        step: the optimizer step of the weights.
        kind: a full model, a LoRA adapter, or a GGUF file.
        folder: the folder's own name, as the loading examples use it.
        files: what the folder holds, Markdown (the GGUF details).
        merged: a LoRA run exported with the adapter folded into the base weights.
    """
    base = cfg.model.name_or_path
    hub_base = not (base.startswith(("/", ".", "~")) or Path(base).exists()) and "/" in base
    lora = cfg.model.lora is not None
    front = ["---", f"library_name: {'peft' if kind == 'adapter' else 'transformers' if kind == 'model' else 'gguf'}"]
    if hub_base:
        front.append(f"base_model: {base}")
    front += ["tags:", "- scaletune", *(["- lora"] if lora else []), *(["- gguf"] if kind == "gguf" else []), "---"]
    what = {
        "adapter": "a LoRA adapter, to be loaded on its base model",
        "model": "the LoRA adapter merged into the base weights" if (lora and merged) else "full weights",
        "gguf": "one GGUF file" + (" (LoRA adapter merged into the base weights)" if lora else ""),
    }[kind]
    stages = resolve_stages(cfg)
    lines = [
        *front,
        "",
        f"# {folder}",
        "",
        f"Fine-tuned with scaletune ({what}). {source} (step {step}).",
        "",
        "## Base model",
        "",
        f"- `{shown(base)}`; licence: {base_licence(base)}",
        "",
        "## Training data",
        "",
    ]
    lines += _data_lines(stages)
    objectives = ", ".join(dict.fromkeys(f"{s.name}: {s.training.objective}" for s in stages))
    lines += [
        "",
        "## Training",
        "",
        f"- stages and objectives: {objectives}",
        f"- {step} optimizer steps, learning rate {cfg.training.learning_rate:g}, "
        f"global batch {cfg.training.global_batch_size}, max_seq_length {cfg.data.max_seq_length}",
        f"- strategy: {cfg.distributed.strategy}" + (f", LoRA r={cfg.model.lora.r}" if cfg.model.lora else ""),
    ]
    lines += (
        _evaluation(run_dir, step) + _samples(run_dir) + ["", "## How to load it", "", *_loading(kind, folder, base)]
    )
    if files:
        lines += ["", "## Files", "", files]
    return "\n".join(lines) + "\n"


def _data_lines(stages: list) -> list[str]:
    """One line per data file of the stages (train and eval, each once), with its licence."""
    lines, seen = [], set()
    for stage in stages:
        for role, source in (("train", stage.data.train), ("eval", stage.data.eval)):
            if source is None:
                continue
            for path in [source.path] if isinstance(source.path, str) else source.path:
                if (role, path) in seen:
                    continue
                seen.add((role, path))
                limit = f", first {source.max_samples} records" if source.max_samples else ""
                lines.append(
                    f"- {role}: `{shown(path)}` (format `{source.format}`{limit}); licence: {data_licence(path)}"
                )
        if stage.data.dummy is not None:
            lines.append("- train: generated token ids (`data.dummy`), no text")
    return lines


def _front_matter(text: str) -> str:
    if not text.startswith("---"):
        return ""
    end = text.find("\n---", 3)
    return text[3:end] if end > 0 else ""


def _rows(run_dir: Path | None, name: str) -> list[dict]:
    """The JSON objects of the run's `name` (metrics.jsonl, samples.jsonl), one per line; a line
    that is not one (a run cut off mid-write) is skipped: a card is a summary, not a check."""
    path = run_dir / name if run_dir is not None else None
    if path is None or not path.is_file():
        return []
    return json_lines(path.read_text(errors="replace"))


def _evaluation(run_dir: Path | None, step: int) -> list[str]:
    """The first and the last evaluation up to `step` (the run's metrics.jsonl), every eval_ figure."""
    evals = [
        r
        for r in _rows(run_dir, "metrics.jsonl")
        if "eval_loss" in r and isinstance(r.get("step"), int) and r["step"] <= step
    ]
    if not evals:
        return ["", "## Evaluation", "", "- no evaluation was logged up to this step"]
    out = ["", "## Evaluation", "", "Held-out figures of the run's own evaluation (metrics.jsonl):", ""]
    for r in [evals[0], evals[-1]] if len(evals) > 1 else evals:
        figures = ", ".join(f"{k} {v:.4f}" for k, v in r.items() if k.startswith("eval_") and isinstance(v, float))
        out.append(f"- step {r['step']}: {figures}")
    return out


def _samples(run_dir: Path | None) -> list[str]:
    """The run's sample prompts answered before and after training (samples.jsonl), when there are any."""
    rows = [
        r
        for r in _rows(run_dir, "samples.jsonl")
        if isinstance(r.get("prompt"), str) and isinstance(r.get("trained"), str)
    ]
    if not rows:
        return []
    out = ["", "## Sample answers", "", "Greedy answers of the base model and of the run's final model:", ""]
    for r in rows:
        out += [f"**{r['prompt']}**", "", f"- before: {r.get('base', '')}", f"- after: {r['trained']}", ""]
    return out[:-1]


def _loading(kind: Kind, folder: str, base: str) -> list[str]:
    if kind == "gguf":
        return ["```bash", f"llama-cli -m {folder}/*.gguf -cnv", "```"]
    if kind == "adapter":
        code = [
            "from peft import AutoPeftModelForCausalLM",
            "from transformers import AutoTokenizer",
            "",
            f'model = AutoPeftModelForCausalLM.from_pretrained("{folder}")  # its base: {shown(base)}',
            f'tokenizer = AutoTokenizer.from_pretrained("{folder}")',
        ]
    else:
        code = [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{folder}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{folder}")',
        ]
    return ["```python", *code, "```", "", f"or talk to it: `scaletune chat {folder}`"]
