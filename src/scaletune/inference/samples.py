"""`training.sample_prompts`: the same prompts answered by the model before training and by the
trained `final/` after it, written side by side to `samples.md` (for people) and `samples.jsonl`
(one `{prompt, base, trained}` object per prompt)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scaletune.config import Config
from scaletune.env import print0
from scaletune.inference.generate import Sampling, generate, generation_steps
from scaletune.inference.loading import inference_dtype, load_for_inference, load_model_config
from scaletune.resolve import RunSpec

JSONL = "samples.jsonl"
MARKDOWN = "samples.md"


def base_answers(cfg: Config, run_dir: Path, resuming: bool = False) -> list[str]:
    """The untrained model's answers to `cfg.training.sample_prompts` (greedy); on a resumed run, the
    answers the first start wrote to `samples.jsonl` when they are for the same prompts."""
    prompts = cfg.training.sample_prompts
    earlier = _read(run_dir / JSONL) if resuming else []
    if earlier and [r.get("prompt") for r in earlier] == prompts and all("base" in r for r in earlier):
        return [r["base"] for r in earlier]
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_cfg = cfg.model.model_copy(update={"dtype": inference_dtype("auto", torch.device(device))})
    loaded = load_model_config(model_cfg, cfg.data, name=f"{cfg.model.name_or_path} (before training)")
    answers = _answered(loaded, list(prompts), cfg.training.sample_max_new_tokens, "sample answers before training")
    del loaded
    return answers


def trained_answers(cfg: Config, run_dir: Path) -> list[str]:
    """The answers of the run's `final/` (an adapter on its base, or the full model), greedy."""
    loaded = load_for_inference(run_dir)
    return _answered(
        loaded, list(cfg.training.sample_prompts), cfg.training.sample_max_new_tokens, "sample answers after training"
    )


def _answered(loaded: Any, prompts: list[str], max_new_tokens: int, what: str) -> list[str]:
    """Greedy answers with the phase's progress on the console (generation can take minutes on a CPU)."""
    from scaletune.inference.progress import PhaseProgress

    sampling = Sampling(max_new_tokens=max_new_tokens)
    with PhaseProgress(what, generation_steps(len(prompts), sampling), "tokens") as progress:
        return generate(loaded, prompts, sampling, progress=progress)


def before_training(spec: RunSpec) -> list[str] | None:
    """Rank 0 of a run with sample prompts: :func:`base_answers`. Other ranks and runs without
    prompts: None."""
    cfg, run_dir = spec.config, spec.run_dir
    if not (cfg.training.sample_prompts and spec.env.is_main):
        return None
    print0(f"[scaletune] answering {len(cfg.training.sample_prompts)} sample prompts before training")
    return base_answers(cfg, run_dir, spec.resume_from is not None)


def record_base(spec: RunSpec, base: list[str] | None) -> None:
    """Write the base answers as soon as the run directory exists, so they are there to read while
    the run trains, and a resumed run reuses them rather than answering again."""
    if base is not None:
        write_samples(spec.run_dir, spec.config.training.sample_prompts, base)


def after_training(spec: RunSpec, base: list[str] | None) -> None:
    """The trained answers beside the base ones (`base` from :func:`before_training`; nothing when
    None): samples.jsonl, samples.md, and the terminal."""
    if base is None:
        return
    cfg, run_dir = spec.config, spec.run_dir
    prompts = cfg.training.sample_prompts
    trained = trained_answers(cfg, run_dir)
    path = write_samples(run_dir, prompts, base, trained)
    print0(f"[scaletune] sample answers before and after training ({path}):\n{render_text(prompts, base, trained)}")


def write_samples(run_dir: Path, prompts: list[str], base: list[str], trained: list[str] | None = None) -> Path:
    """`samples.jsonl` and `samples.md`; `trained` is None before training ends. Returns the .md path."""
    rows = [{"prompt": p, "base": b, **({"trained": t} if trained else {})} for p, b, t in _zip(prompts, base, trained)]
    (run_dir / JSONL).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    lines = ["# Samples: the same prompts before and after training", ""]
    lines += ["Greedy decoding, prompted as the model was trained. **base**: the model before the first step;"]
    lines += ["**trained**: the run's `final/`.", ""]
    for r in rows:
        lines += [f"## {r['prompt']}", "", "**base**", "", _quote(r["base"]), ""]
        if "trained" in r:
            lines += ["**trained**", "", _quote(r["trained"]), ""]
    out = run_dir / MARKDOWN
    out.write_text("\n".join(lines))
    return out


def render_text(prompts: list[str], base: list[str], trained: list[str]) -> str:
    """The before/after answers for the terminal."""
    out = []
    for p, b, t in zip(prompts, base, trained):
        out += [f">>> {p}", f"  before: {_one_line(b)}", f"  after:  {_one_line(t)}"]
    return "\n".join(out)


def _zip(prompts: list[str], base: list[str], trained: list[str] | None):
    return zip(prompts, base, trained if trained else [None] * len(prompts))


def _quote(text: str) -> str:
    return "\n".join(f"> {line}" if line else ">" for line in (text or "(empty)").splitlines())


def _one_line(text: str, width: int = 200) -> str:
    flat = " ".join(text.split()) or "(empty)"
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except ValueError:
        return []
