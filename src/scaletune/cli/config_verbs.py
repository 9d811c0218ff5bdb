"""`scaletune config ...`: a first config for your own data (`new`), standalone DeepSpeed / FSDP
configs for other trainers, a config resolved with every default (`show`), and the reference
generated from the schema (`reference`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from scaletune.cli.app import ConfigArg, OverridesArg, config_app, emit, resolved
from scaletune.errors import UserError


@config_app.command("new")
def config_new(
    data: Annotated[Path, typer.Argument(help="Your data file: .jsonl (one record per line) or .json (a list).")],
    output: Annotated[
        Path, typer.Option("-o", "--output", help="Where to write the config (an existing file is refused).")
    ] = Path("config.yaml"),
    model: Annotated[
        str, typer.Option("--model", help="The base model: a preset, a local folder or a hub id.")
    ] = "smollm2-135m-instruct",
) -> None:
    """A first config for your own data file: its format detected from the first record's keys
    (`messages`; `instruction` + `output`: alpaca; `text`; `prompt` + `chosen` + `rejected`:
    preference, trained with DPO; `prompt` + `completion` + `label`: KTO), every record checked in
    that format, LoRA on the base model, about 10 % held out for the eval loss. Walkthrough:
    docs/own-data.md.

    Example: `scaletune config new my_data.jsonl -o my.yaml`, then `scaletune train my.yaml --check`.
    """
    from scaletune.config import DataSource
    from scaletune.config.starter import SIGNATURES, detect_format, starter_config
    from scaletune.data.sources import json_records, jsonl_records, load_records

    problems = []
    if output.exists():
        problems.append(f"{output} exists: give another -o (nothing is overwritten)")
    if not data.is_file():
        raise UserError([f"{data}: no such data file", *problems], title="cannot write a config")
    raw = data.read_bytes()
    found: list[str] = []
    first = (
        next((r for _, r in jsonl_records(raw, str(data), 1, found)), None)
        if data.suffix == ".jsonl"
        else next(iter(json_records(raw, str(data), 1)), None)
    )
    fmt = detect_format(first)
    if fmt is None:
        keys = sorted(first) if isinstance(first, dict) else type(first).__name__
        known = "; ".join(f"{f}: {', '.join(k)}" for f, k in SIGNATURES)
        raise UserError(
            [*found, f"{data}: record 1 ({keys}) has the keys of no format ({known})", *problems],
            title="cannot write a config",
        )
    records = load_records(DataSource(path=str(data), format=fmt))  # every record, in that format (exit 2)
    if problems:
        raise UserError(problems, title="cannot write a config")
    output.write_text(starter_config(str(data), fmt, len(records), model=model, name=str(output)))
    typer.echo(
        f"wrote {output}: {len(records)} records of format {fmt} (keys {', '.join(dict(SIGNATURES)[fmt])}); "
        f"next: scaletune train {output} --check"
    )


@config_app.command("deepspeed")
def config_deepspeed(
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write the JSON here (default: print it).")
    ] = None,
    zero_stage: Annotated[int, typer.Option(help="ZeRO stage 0-3.")] = 2,
    offload_optimizer: Annotated[
        bool, typer.Option("--offload-optimizer", help="Optimizer state and step on the CPU.")
    ] = False,
    offload_params: Annotated[bool, typer.Option("--offload-params", help="Parameters on the CPU (ZeRO-3).")] = False,
    bf16: Annotated[bool, typer.Option("--bf16", help="bf16 mixed precision (default: auto).")] = False,
    fp16: Annotated[
        bool, typer.Option("--fp16", help="fp16 mixed precision with dynamic loss scaling (default: auto).")
    ] = False,
    fp32: Annotated[bool, typer.Option("--fp32", help="No mixed precision (default: auto).")] = False,
    gradient_accumulation_steps: Annotated[int | None, typer.Option(help="Default: auto.")] = None,
    gradient_clipping: Annotated[float | None, typer.Option(help="Default: auto.")] = None,
    micro_batch_size: Annotated[int | None, typer.Option(help="Per-GPU micro batch (default: auto).")] = None,
    train_batch_size: Annotated[
        int | None,
        typer.Option(
            help="Global batch, all GPUs (default: auto, or derived by DeepSpeed when micro batch and accumulation are given)."
        ),
    ] = None,
) -> None:
    """DeepSpeed JSON (`auto` where the Hugging Face Trainer fills the value)."""
    import json

    from scaletune.launch.configs import deepspeed_config

    if bf16 + fp16 + fp32 > 1:
        raise UserError("give at most one of --bf16, --fp16, --fp32", title="invalid deepspeed options")
    precision = "bf16" if bf16 else "fp16" if fp16 else "fp32" if fp32 else "auto"
    cfg = deepspeed_config(
        zero_stage,
        offload_optimizer,
        offload_params,
        precision,
        gradient_accumulation_steps,
        gradient_clipping,
        micro_batch_size,
        train_batch_size,
    )
    text = json.dumps(cfg, indent=2) + "\n"
    emit(text, output)


@config_app.command("fsdp")
def config_fsdp(
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write the config here (default: print it).")
    ] = None,
    reshard_after_forward: Annotated[
        bool,
        typer.Option(
            "--reshard-after-forward/--no-reshard-after-forward",
            help="Free gathered parameters after forward (ZeRO-3-like) or keep them (ZeRO-2-like).",
        ),
    ] = True,
    mixed_precision: Annotated[str, typer.Option(help="bf16, fp16 or no.")] = "bf16",
    cpu_offload: Annotated[
        bool, typer.Option("--cpu-offload", help="Parameters, gradients and optimizer state on the CPU.")
    ] = False,
    state_dict_type: Annotated[str, typer.Option(help="Checkpoints: sharded or full.")] = "sharded",
    activation_checkpointing: Annotated[
        bool, typer.Option("--activation-checkpointing", help="FSDP's own activation checkpointing.")
    ] = False,
    format: Annotated[
        str,
        typer.Option(
            "--format",
            help="trainer (JSON for TrainingArguments.fsdp_config) or accelerate (YAML for accelerate launch).",
        ),
    ] = "trainer",
) -> None:
    """FSDP2 config for the Hugging Face Trainer or `accelerate launch`."""
    from scaletune.launch.configs import fsdp_config

    text, _ = fsdp_config(
        reshard_after_forward,
        mixed_precision,
        cpu_offload,
        state_dict_type,  # type: ignore[arg-type]
        activation_checkpointing,
        format,
    )  # type: ignore[arg-type]
    emit(text, output)


@config_app.command("show", context_settings={"allow_interspersed_args": True})
def config_show(config: ConfigArg, overrides: OverridesArg = None) -> None:
    """The config resolved for this machine: every default filled in, `auto` decided, the stages
    merged, and the derived numbers (strategy, precision, device mesh, batch arithmetic) in a header."""
    from scaletune.config import dump_config

    spec = resolved(config, overrides)
    header = [
        f"# resolved for world_size {spec.world_size} ({spec.env.describe()})",
        f"# strategy: {spec.strategy_label} ({spec.reason})",
        f"# precision: compute {spec.precision.compute}, weights stored {spec.precision.storage}"
        f"{', autocast' if spec.precision.autocast else ''}{', bf16 parameter copies' if spec.precision.cast_params else ''}",
        f"# mesh: {spec.mesh.describe()}",
        f"# batch: {spec.batch.describe()}",
    ]
    header += [
        f"# stage {s.name}: data.max_seq_length {s.data.max_seq_length}, learning_rate {s.training.learning_rate}"
        for s in spec.stages
    ]
    typer.echo("\n".join(header) + "\n" + dump_config(spec.config), nl=False)


@config_app.command("reference")
def config_reference(
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write the Markdown here (default: print it).")
    ] = None,
) -> None:
    """The config reference (every key, type, default and meaning), generated from the schema: the
    text of docs/config.md."""
    from scaletune.config.docs import reference_markdown

    emit(reference_markdown(), output)
