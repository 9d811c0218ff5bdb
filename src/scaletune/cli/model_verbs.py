"""Verbs that talk to a trained run or any model: `chat`, `generate`, `eval`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from scaletune.cli.app import app

TargetArg = Annotated[
    str,
    typer.Argument(
        help="A run directory (its final/), a checkpoint (RUN/checkpoints/step-N, exported first), a model or "
        "LoRA adapter folder, a pretrained preset name "
        "(smollm2-135m-instruct) or a hub id."
    ),
]
DtypeOpt = Annotated[
    str, typer.Option(help="Weights dtype: auto (bfloat16 on a GPU, float32 on the CPU), float32, bfloat16, float16.")
]
TemplateOpt = Annotated[
    str,
    typer.Option(
        help="Prompt format: auto (as the run trained; else the chat template if the tokenizer has one), "
        "chat, alpaca or none."
    ),
]
MaxNewOpt = Annotated[int, typer.Option(min=1, help="Longest answer, in tokens.")]
TemperatureOpt = Annotated[float, typer.Option(min=0.0, help="0: greedy (deterministic); above 0: sampling.")]
TopPOpt = Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling mass (with temperature > 0).")]
SeedOpt = Annotated[int, typer.Option(help="Seed of sampling.")]
TrustOpt = Annotated[
    bool, typer.Option("--trust-remote-code", help="Run Python code shipped in the model folder (off by default).")
]


def _load(target: str, dtype: str, template: str, trust_remote_code: bool):
    from scaletune.inference import load_for_inference

    return load_for_inference(target, dtype=dtype, template=template, trust_remote_code=trust_remote_code)


@app.command()
def chat(
    target: TargetArg,
    system: Annotated[str | None, typer.Option(help="System message opening the conversation.")] = None,
    image: Annotated[
        Path | None,
        typer.Option(help="An image the first message shows (a vision-language model; again after /reset)."),
    ] = None,
    max_new_tokens: MaxNewOpt = 256,
    temperature: TemperatureOpt = 0.7,
    top_p: TopPOpt = 0.9,
    seed: SeedOpt = 0,
    dtype: DtypeOpt = "auto",
    template: TemplateOpt = "auto",
    trust_remote_code: TrustOpt = False,
) -> None:
    """Talk to a model: each line you type is answered as the tokens arrive, with the whole
    conversation as context. /reset forgets it; /exit or Ctrl-D ends. Reads standard input, so
    `echo "Who are you?" | scaletune chat RUN` works too.

    Example: `scaletune chat runs/quickstart`
    """
    from scaletune.inference import Sampling
    from scaletune.inference.chat import HELP, chat_loop

    loaded = _load(target, dtype, template, trust_remote_code)
    shown = _image(image, loaded) if image is not None else None
    interactive = sys.stdin.isatty()
    if interactive:
        typer.echo(f"{loaded.description}\n{HELP}", err=True)

    def read(prompt: str) -> str:
        if interactive:
            return input(prompt)
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line

    sampling = Sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    chat_loop(loaded, sampling, read=read, out=sys.stdout, system=system, image=shown)


def _image(path: Path, loaded) -> str:
    """`--image`'s file, absolute, once its header reads as an image within Pillow's bound.

    Raises:
        UserError: a text model, a missing file or one that is not an image.
    """
    from scaletune.data.sources import MAX_IMAGE_PIXELS, read_image
    from scaletune.errors import UserError

    if loaded.processor is None:
        raise UserError(f"--image: {loaded.description.split(',')[0]} is a text model", title="invalid arguments")
    try:
        read_image(str(path), MAX_IMAGE_PIXELS, decode=False)
    except ValueError as exc:
        raise UserError(f"--image {path}: {exc}", title="invalid arguments") from None
    return str(path.resolve())


@app.command()
def generate(
    target: TargetArg,
    prompts: Annotated[
        Path,
        typer.Option(
            help="Prompts: .txt (one per line), .jsonl (objects with `prompt` or `messages`) or .json (a list)."
        ),
    ],
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="JSONL file to write (default: stdout).")
    ] = None,
    max_new_tokens: MaxNewOpt = 256,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 0.9,
    seed: SeedOpt = 0,
    batch_size: Annotated[int, typer.Option(min=1, help="Prompts generated together.")] = 8,
    dtype: DtypeOpt = "auto",
    template: TemplateOpt = "auto",
    trust_remote_code: TrustOpt = False,
) -> None:
    """Answer every prompt of a file, in batches; write one JSON object per prompt
    ({"prompt", "response"}) to a JSONL file or standard output.

    Example: `scaletune generate runs/quickstart --prompts questions.txt -o answers.jsonl`
    """
    from scaletune.inference import Sampling, read_prompts
    from scaletune.inference import generate as run_generate

    items = read_prompts(prompts)
    loaded = _load(target, dtype, template, trust_remote_code)
    sampling = Sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    answers = run_generate(loaded, items, sampling, batch_size=batch_size)
    text = "".join(json.dumps({"prompt": p, "response": a}, ensure_ascii=False) + "\n" for p, a in zip(items, answers))
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)
        typer.echo(f"{len(answers)} answers written to {output}", err=True)


@app.command("eval")
def eval_(
    target: TargetArg,
    data: Annotated[
        str | None,
        typer.Option(
            help="Data file, folder or data set name (as data.train.path): loss and perplexity; with "
            "--format preference, reward accuracy and margins of its pairs."
        ),
    ] = None,
    tasks: Annotated[
        str | None,
        typer.Option(
            help="lm-evaluation-harness tasks, comma-separated, from the shipped local set (alpaca_mc, alpaca_ppl); "
            "instead of --data. Needs the eval extra."
        ),
    ] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="--tasks: the first N items of each task only.")] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "-o",
            "--output",
            help="--tasks and --format preference: folder for the results (default: the run's eval/; none for "
            "other models).",
        ),
    ] = None,
    format: Annotated[
        str | None,
        typer.Option(
            "--format",
            help="alpaca, messages, text (default: the run's, else alpaca) or preference ({prompt, chosen, "
            "rejected} pairs: reward accuracy and margins).",
        ),
    ] = None,
    reference: Annotated[
        str | None,
        typer.Option(
            help="--format preference: the reference model (folder, run, preset or hub id). Default: a LoRA "
            "adapter's own base (adapter disabled), else the run's model.name_or_path; none for a model "
            "without a run (log-prob margins only)."
        ),
    ] = None,
    beta: Annotated[
        float | None,
        typer.Option(help="--format preference: the rewards' beta (default: the run's, else 0.1)."),
    ] = None,
    field: Annotated[str | None, typer.Option(help="Column holding the records (text / messages).")] = None,
    max_seq_length: Annotated[
        int | None, typer.Option(min=8, help="Tokens per example (default: the run's, else 1024).")
    ] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Examples per forward pass.")] = 8,
    dtype: DtypeOpt = "auto",
    template: TemplateOpt = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON for machines.")] = False,
    trust_remote_code: TrustOpt = False,
) -> None:
    """With --data: mean loss and perplexity on a data set, over the tokens training would train
    (the same prompt format, masking and truncation), so it compares with eval_loss in
    metrics.jsonl. With --data and --format preference: over {prompt, chosen, rejected} pairs,
    rendered and masked as training does, the reward accuracy (chosen reward strictly above
    rejected), mean reward margin and mean log-probs of chosen and rejected answers, against the
    reference (--reference); table printed, JSON written to the run's eval/ (or --output). With --tasks: zero-shot benchmarks through EleutherAI's lm-evaluation-harness
    on task data shipped with scaletune (offline); prints the harness's table and writes its
    results (per task and per item) as JSON to the run's eval/ (or --output).

    Example: `scaletune eval runs/quickstart --data held_out.jsonl --format messages`
    """
    from scaletune.errors import UserError
    from scaletune.inference.evaluate import eval_data_config, evaluate

    problems: list[str] = []
    if (data is None) == (tasks is None):
        problems.append("give exactly one of --data (loss and perplexity) and --tasks (lm-eval benchmarks)")
    if format is not None and format not in ("alpaca", "messages", "text", "preference"):
        problems.append(f"--format {format}: use alpaca, messages, text or preference")
    pairs = format == "preference"
    if beta is not None and not beta > 0:
        problems.append(f"--beta {beta}: must be above 0")
    if not pairs:
        problems += [
            f"{f} applies to --format preference"
            for f, v in (("--reference", reference), ("--beta", beta))
            if v is not None
        ]
    names: list[str] = []
    if tasks is not None:
        from scaletune.inference.lm_eval_tasks import parse_tasks

        try:
            names = parse_tasks(tasks)
        except UserError as exc:
            problems += exc.problems
        given = [f for f, v in (("--format", format), ("--field", field), ("--max-seq-length", max_seq_length)) if v]
        problems += [f"{f} applies to --data, not --tasks" for f in given]
        if template != "auto":  # the harness writes each task's own prompt, as its YAML says
            problems.append(f"--template {template} applies to --data, not --tasks (a task's prompt is its own)")
    elif data is not None:
        given = [f for f, v in (("--limit", limit), ("--output", None if pairs else output)) if v is not None]
        problems += [f"{f} applies to --tasks, not --data" for f in given]
        if pairs and field is not None:
            problems.append("--field applies to text and messages data, not --format preference")
    plan = None
    if pairs and tasks is None:
        from scaletune.inference.evaluate import preference_plan
        from scaletune.inference.loading import find_target

        try:
            plan = preference_plan(find_target(target), reference, beta)
        except UserError as exc:
            problems += exc.problems
    if problems:
        raise UserError(problems, title="invalid arguments")
    loaded = _load(target, dtype, template, trust_remote_code)
    if tasks is not None:
        from scaletune.inference.lm_eval_tasks import default_out_dir, run_tasks, tasks_description, write_report

        report = run_tasks(loaded, names, limit=limit, batch_size=batch_size)
        out_dir = output or default_out_dir(target)
        path = write_report(report, out_dir) if out_dir is not None else None
        if json_out:
            typer.echo(json.dumps({"results": report["results"], "file": str(path) if path else None}))
            return
        typer.echo(f"{tasks_description(loaded)}; {report['seconds']} s\n{report['table']}")
        typer.echo(f"results: {path}" if path else "results not written (not a run; give --output DIR)", err=True)
        return
    assert data is not None
    if plan is not None:
        _eval_pairs(loaded, plan, target, data, max_seq_length, batch_size, output, json_out, dtype, trust_remote_code)
        return
    result = evaluate(loaded, eval_data_config(loaded, data, format, max_seq_length, field), batch_size=batch_size)
    if json_out:
        typer.echo(json.dumps(result))
        return
    typer.echo(
        f"loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f}  "
        f"({result['target_tokens']:,} target tokens in {result['examples']} examples; {loaded.description})"
    )


def _eval_pairs(loaded, plan, target, data, max_seq_length, batch_size, output, json_out, dtype, trust) -> None:
    """`eval --format preference`: the reference loaded where the plan names one, the table
    printed and the JSON written (the run's eval/ or --output), as --tasks does."""
    from scaletune.inference.evaluate import (
        evaluate_preference,
        preference_data_config,
        preference_table,
        write_preference_report,
    )
    from scaletune.inference.lm_eval_tasks import default_out_dir

    ref_model = None
    if plan.rewards == "reference" and plan.reference != "adapter":
        ref_model = _load(plan.reference, dtype, "none", trust).model
    cfg = preference_data_config(loaded, plan, data, max_seq_length)
    result = evaluate_preference(loaded, cfg, plan, reference_model=ref_model, batch_size=batch_size)
    out_dir = output or default_out_dir(target)
    path = write_preference_report(result, out_dir) if out_dir is not None else None
    if json_out:
        typer.echo(json.dumps({**result, "file": str(path) if path else None}))
        return
    typer.echo(f"{loaded.description}\n{preference_table(result)}")
    typer.echo(f"results: {path}" if path else "results not written (not a run; give --output DIR)", err=True)
