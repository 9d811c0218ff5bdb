"""Benchmarks through EleutherAI's lm-evaluation-harness (`scaletune eval --tasks`), on task data
that ships with scaletune (assets/eval_tasks/), so it runs offline.

The harness is an optional dependency (the `eval` extra); it is imported only here, when a task
runs. The model is the one `load_for_inference` loaded (a run's final/, a model folder, a preset),
handed to the harness's `hf` model as an object: the same dtype, device and tokenizer as `chat` and
`eval --data`, and a LoRA adapter merged into its base in memory (nothing written to disk).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from scaletune.errors import UserError
from scaletune.inference.loading import LoadedModel

TASKS_DIR = Path(__file__).resolve().parent.parent / "assets" / "eval_tasks"


def available_tasks(tasks_dir: Path = TASKS_DIR) -> dict[str, Path]:
    """The shipped tasks: name (the YAML's `task`) -> its YAML file."""
    import yaml

    found = {}
    for path in sorted(tasks_dir.glob("*.yaml")):
        name = (yaml.safe_load(path.read_text()) or {}).get("task")
        if isinstance(name, str):
            found[name] = path
    return found


def parse_tasks(spec: str) -> list[str]:
    """`--tasks a,b` -> the names, in order, without blanks or repeats.

    Raises:
        UserError: no name given, or a name that is not a shipped task (every unknown one, with the
            list of known ones).
    """
    names = list(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    known = available_tasks()
    listing = ", ".join(known) or "(none shipped)"
    if not names:
        raise UserError(f"--tasks {spec!r}: name at least one task; available: {listing}", title="invalid arguments")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserError(
            [f"--tasks: unknown task {n!r}" for n in unknown] + [f"available tasks: {listing}"],
            title="invalid arguments",
        )
    return names


def render_tasks(names: list[str], dest: Path, cache_dir: Path) -> None:
    """Write the YAMLs of `names` into `dest` with their `data_files` made absolute (lm-eval hands
    them to `datasets.load_dataset`, which reads relative paths against the working directory) and
    the `datasets` cache in `cache_dir` (a run leaves nothing in ~/.cache)."""
    import yaml

    known = available_tasks()
    for name in names:
        cfg = yaml.safe_load(known[name].read_text())
        kwargs = dict(cfg.get("dataset_kwargs") or {})
        files = kwargs.get("data_files")
        if isinstance(files, dict):
            kwargs["data_files"] = {split: str(known[name].parent / f) for split, f in files.items()}
        elif isinstance(files, str):
            kwargs["data_files"] = str(known[name].parent / files)
        kwargs["cache_dir"] = str(cache_dir)
        cfg["dataset_kwargs"] = kwargs
        (dest / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def run_tasks(
    loaded: LoadedModel, names: list[str], *, limit: int | None = None, batch_size: int = 8, seed: int = 0
) -> dict[str, Any]:
    """Evaluate `loaded` on the shipped tasks `names` (zero-shot) with lm-eval's `simple_evaluate`.

    Args:
        loaded: the model and tokenizer (:func:`scaletune.inference.load_for_inference`).
        names: task names, checked by :func:`parse_tasks`.
        limit: the first `limit` items of each task only (None: all).
        batch_size: requests per forward pass.
        seed: the harness's Python, NumPy and torch seeds.

    Returns:
        A JSON-ready dict: `results` (task -> metric -> value, as the harness reports it, with
        `,none` filter suffixes), `n-samples`, `versions`, `n-shot`, `higher_is_better`, `configs`,
        `samples` (task -> per item: `doc_id`, `target`, `loglikelihoods` (one per choice or the
        rolling one), the item's metrics), `table` (the harness's markdown table), `model`,
        `limit`, `seconds`, `lm_eval_version`.

    Raises:
        UserError: lm-eval is not installed (the `eval` extra).
    """
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import handle_non_serializable, make_table
    except ImportError:
        raise UserError(
            "--tasks needs EleutherAI's lm-evaluation-harness: pip install 'scaletune[eval]' (lm-eval)",
            title="missing dependency",
        ) from None

    # Offline by construction: the data are local files; nothing should ask the hub.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    model = loaded.model
    if hasattr(model, "merge_and_unload"):  # a peft adapter: the harness wants a PreTrainedModel
        model = model.merge_and_unload()
    lm = HFLM(pretrained=model, tokenizer=loaded.tokenizer, batch_size=batch_size)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="scaletune-lm-eval-") as tmp:
        include, cache = Path(tmp) / "tasks", Path(tmp) / "cache"
        include.mkdir()
        render_tasks(names, include, cache)
        manager = TaskManager(include_path=str(include), include_defaults=False)
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=names,
            task_manager=manager,
            limit=limit,
            log_samples=True,
            bootstrap_iters=1000,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    assert out is not None  # only None on ranks other than 0 of a multi-process harness run
    report = {k: out.get(k) for k in ("results", "n-samples", "versions", "n-shot", "higher_is_better", "configs")}
    report["samples"] = {task: [_sample(s) for s in rows] for task, rows in (out.get("samples") or {}).items()}
    report["table"] = make_table(out)
    report.update(
        model=tasks_description(loaded),
        limit=limit,
        seconds=round(time.perf_counter() - start, 2),
        lm_eval_version=getattr(lm_eval, "__version__", None),
    )
    return json.loads(json.dumps(report, default=handle_non_serializable))


def tasks_description(loaded: LoadedModel) -> str:
    """What was evaluated, and how: each task writes its own zero-shot prompts, and the harness
    applies no chat template (`simple_evaluate` without `apply_chat_template`), whatever the run
    was trained with."""
    return f"{loaded.loaded}, prompts: each task's own, zero-shot (no chat template)"


def _sample(s: dict[str, Any]) -> dict[str, Any]:
    """One logged item, without the prompt text (the task file has it): its log-likelihoods."""
    lls = [r[0] if isinstance(r, list | tuple) else r for r in s.get("filtered_resps", [])]
    metrics = {m: s[m] for m in s.get("metrics", []) if m in s}
    return {"doc_id": s.get("doc_id"), "target": s.get("target"), "loglikelihoods": lls, **metrics}


def write_report(report: dict[str, Any], out_dir: Path) -> Path:
    """Write `report` as `lm_eval-<UTC time>.json` and its table as `.md` beside it in `out_dir`
    (created); returns the JSON's path.

    Raises:
        UserError: `out_dir` cannot be created or written.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"lm_eval-{stamp}.json"
        n = 1
        while path.exists():  # two evaluations in one second keep both
            path, n = out_dir / f"lm_eval-{stamp}-{n}.json", n + 1
        path.write_text(json.dumps(report, indent=1) + "\n")
        path.with_suffix(".md").write_text(report["table"])
    except OSError as exc:
        raise UserError(f"{out_dir}: cannot write the results: {exc}", title="invalid arguments") from None
    return path


def default_out_dir(target: str) -> Path | None:
    """`eval/` of the run RUN_OR_MODEL names (a run directory or its final/), else None."""
    p = Path(target).expanduser()
    if (p / "config.yaml").is_file() and not (p / "config.json").is_file():
        return p / "eval"
    if p.is_dir() and (p.parent / "config.yaml").is_file():
        return p.parent / "eval"
    return None
