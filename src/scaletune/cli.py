"""The `scaletune` command line: one thin function per verb (DESIGN.md); the work lives below.

Exit codes: 0 success; 2 bad input (config, data, arguments) with every problem named and no
traceback; 1 anything else, with the traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from scaletune.errors import UserError

app = typer.Typer(
    name="scaletune",
    help="Fine-tune LLMs with one YAML file, from one CPU to many GPUs on many nodes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _emit(text: str, output: Path | None) -> None:
    """Print generated text, or write it to `output` and print the path."""
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)
        typer.echo(str(output))


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="YAML config (see README: config reference).")],
    overrides: Annotated[Optional[list[str]], typer.Argument(help="Dotted overrides, e.g. training.learning_rate=1e-4.")] = None,
) -> None:
    """Train. Under torchrun, the deepspeed launcher or srun, each rank runs this. Started plainly
    with more than one process wanted (distributed.num_processes), it re-executes itself under
    torchrun with one process per device."""
    from scaletune.train import run_from_cli

    run_from_cli(config, overrides or [])


@app.command("init-model")
def init_model(
    preset: Annotated[str, typer.Argument(help="Preset name: see --help of this command for the list.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Folder to write the model and tokenizer to.")],
    seed: Annotated[int, typer.Option(help="Seed of the random initialisation.")] = 0,
) -> None:
    """Build a randomly initialised tiny model from a named preset (olmo2-tiny, llama-tiny, ...)
    with the bundled OLMo-2 tokenizer, and save_pretrained it to OUTPUT."""
    from scaletune.models import init_model as _init

    path = _init(preset, output, seed=seed)
    typer.echo(str(path))


# ---------------------------------------------------------------------------------------------
# Launching (issue 4): thin wrappers over scaletune.launch (pure builders).

EnvPresetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--env-preset", help="NCCL/torch.distributed env preset, repeatable: debug, no-p2p, no-ib, no-shm, long-timeouts, socket-ifname=IFACE (docs/launch.md)."),
]


def _command_line() -> str:
    import shlex

    return "scaletune " + " ".join(shlex.quote(a) for a in sys.argv[1:])


@app.command(context_settings={"allow_interspersed_args": True})
def launch(
    config: Annotated[Path, typer.Argument(help="YAML config.")],
    overrides: Annotated[Optional[list[str]], typer.Argument(help="Dotted overrides passed to every rank.")] = None,
    nodes: Annotated[int, typer.Option(help="Number of nodes in the job.")] = 1,
    gpus_per_node: Annotated[Optional[int], typer.Option(help="GPUs per node (default: all visible); 0 for CPU nodes.")] = None,
    procs_per_node: Annotated[Optional[int], typer.Option(help="Ranks per node (CPU nodes; default: the GPU count).")] = None,
    node_rank: Annotated[int, typer.Option(help="This node's index, 0..nodes-1 (0 hosts the rendezvous).")] = 0,
    master_addr: Annotated[Optional[str], typer.Option(help="Address of node 0, reachable from every node.")] = None,
    master_port: Annotated[Optional[int], typer.Option(help="Rendezvous port on node 0 (default 29500; one node: a free port).")] = None,
    launcher: Annotated[str, typer.Option(help="torchrun or deepspeed.")] = "torchrun",
    max_restarts: Annotated[int, typer.Option(help="torchrun: restart the workers up to K times after a failure.")] = 0,
    rdzv_id: Annotated[Optional[str], typer.Option(help="Rendezvous id, the same on every node (default: scaletune-PORT).")] = None,
    env_preset: EnvPresetOpt = None,
    python: Annotated[str, typer.Option(help="Interpreter with scaletune installed, on every node.")] = sys.executable,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the command and its environment; run nothing.")] = False,
    script: Annotated[Optional[Path], typer.Option(help="Write a runnable shell script for this node instead of running.")] = None,
) -> None:
    """Build the torchrun (or deepspeed launcher) command for this node and run it."""
    import os
    import tempfile

    from scaletune.config import load_config
    from scaletune.launch.commands import LaunchOptions, build_launch, render_script

    cfg = load_config(config, overrides or [])
    opts = LaunchOptions(
        config=str(config), overrides=tuple(overrides or ()), nodes=nodes, gpus_per_node=gpus_per_node,
        procs_per_node=procs_per_node, node_rank=node_rank, master_addr=master_addr, master_port=master_port,
        launcher=launcher, max_restarts=max_restarts, rdzv_id=rdzv_id, env_presets=tuple(env_preset or ()),
        config_env=dict(cfg.distributed.env), config_num_processes=cfg.distributed.num_processes, python=python,
    )  # fmt: skip
    if dry_run or script is not None:
        cmd = build_launch(opts)
        if script is not None:
            script.write_text(render_script(cmd, workdir=os.getcwd(), command_line=_command_line()))
            script.chmod(0o755)
            typer.echo(str(script))
        else:
            typer.echo(cmd.dry_run_text(), nl=False)
        return
    hostfile = None
    if launcher == "deepspeed" and nodes > 1:
        fd, hostfile = tempfile.mkstemp(prefix="scaletune-hostfile-")
        os.close(fd)
    from dataclasses import replace

    cmd = build_launch(replace(opts, hostfile=hostfile))
    for path, text in cmd.files.items():
        Path(path).write_text(text)
    typer.echo(f"[scaletune] {cmd.summary}\n[scaletune] {cmd.shell_command()}", err=True)
    os.execvpe(cmd.argv[0], cmd.argv, {**os.environ, **cmd.env})


@app.command(context_settings={"allow_interspersed_args": True})
def slurm(
    config: Annotated[Path, typer.Argument(help="YAML config.")],
    overrides: Annotated[Optional[list[str]], typer.Argument(help="Dotted overrides passed to every rank.")] = None,
    nodes: Annotated[int, typer.Option(help="Number of nodes.")] = 1,
    gpus_per_node: Annotated[Optional[int], typer.Option(help="GPUs per node (required); 0 for CPU nodes, with --procs-per-node.")] = None,
    procs_per_node: Annotated[Optional[int], typer.Option(help="Ranks per node (default: the GPU count).")] = None,
    cpus_per_task: Annotated[Optional[int], typer.Option(help="CPU cores per node for the ranks (default: one per rank).")] = None,
    mem_per_gpu: Annotated[Optional[str], typer.Option(help="Memory per GPU, e.g. 80G.")] = None,
    mem: Annotated[Optional[str], typer.Option(help="Memory per node, e.g. 64G (instead of --mem-per-gpu).")] = None,
    time: Annotated[Optional[str], typer.Option(help="Time limit: MINUTES, HH:MM:SS, D-HH:MM:SS or UNLIMITED.")] = None,
    partition: Annotated[Optional[str], typer.Option(help="SLURM partition.")] = None,
    account: Annotated[Optional[str], typer.Option(help="SLURM account.")] = None,
    job_name: Annotated[str, typer.Option(help="Job name.")] = "scaletune",
    log: Annotated[str, typer.Option(help="Job log file (sbatch --output pattern, relative to the working directory).")] = "%x-%j.out",
    max_restarts: Annotated[int, typer.Option(help="torchrun restarts of the workers after a failure.")] = 0,
    env_preset: EnvPresetOpt = None,
    python: Annotated[str, typer.Option(help="Interpreter with scaletune installed on the nodes.")] = sys.executable,
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Write the script here (default: print it).")] = None,
    submit: Annotated[bool, typer.Option("--submit", help="Hand the script to sbatch and print the job id.")] = False,
) -> None:
    """Write an sbatch script that runs the config across the nodes (one torchrun per node)."""
    import os

    from scaletune.config import load_config
    from scaletune.launch.slurm import SlurmOptions, render_sbatch
    from scaletune.launch.slurm import submit as sbatch_submit

    cfg = load_config(config, overrides or [])
    text = render_sbatch(
        SlurmOptions(
            config=str(config), overrides=tuple(overrides or ()), nodes=nodes, gpus_per_node=gpus_per_node,
            procs_per_node=procs_per_node, cpus_per_task=cpus_per_task, mem_per_gpu=mem_per_gpu, mem=mem,
            time=time, partition=partition, account=account, job_name=job_name, output=log,
            env_presets=tuple(env_preset or ()), config_env=dict(cfg.distributed.env), max_restarts=max_restarts,
            python=python, workdir=os.getcwd(),
        ),  # fmt: skip
        command_line=_command_line(),
    )
    if output is None and submit:
        output = Path(f"{job_name}.sbatch")
    if output is None:
        typer.echo(text, nl=False)
        return
    output.write_text(text)
    output.chmod(0o755)
    if submit:
        typer.echo(sbatch_submit(str(output)))
    else:
        typer.echo(str(output))


@app.command(context_settings={"allow_interspersed_args": True})
def modal(
    config: Annotated[Path, typer.Argument(help="YAML config.")],
    overrides: Annotated[Optional[list[str]], typer.Argument(help="Dotted overrides, applied to the embedded config.")] = None,
    gpu_count: Annotated[int, typer.Option(help="GPUs in the container (1-8); more than 1 runs torchrun.")] = 1,
    gpu_type: Annotated[str, typer.Option(help="Modal GPU type: H100, A100-80GB, L40S, ...")] = "H100",
    app_name: Annotated[Optional[str], typer.Option(help="Modal app name (default: scaletune-CONFIGNAME).")] = None,
    volume: Annotated[str, typer.Option(help="Modal volume for the run directory.")] = "scaletune-runs",
    secret: Annotated[Optional[list[str]], typer.Option("--secret", help="Modal secret to attach (e.g. huggingface), repeatable.")] = None,
    timeout_hours: Annotated[float, typer.Option(help="Function timeout in hours (Modal allows up to 24).")] = 24.0,
    env_preset: EnvPresetOpt = None,
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Write the app here (default: print it).")] = None,
) -> None:
    """Write a Modal app that runs the config on Modal GPUs."""
    import re

    from scaletune.config import load_config
    from scaletune.launch.modal_app import ModalOptions, plan_inputs, render_modal_app, scaletune_requirements

    cfg = load_config(config, overrides or [])
    plan = plan_inputs(cfg.model_dump(mode="json"), Path.cwd())
    name = app_name or "scaletune-" + (re.sub(r"[^A-Za-z0-9._-]+", "-", config.stem).strip("-.") or "run")
    opts = ModalOptions(
        gpu_count=gpu_count, gpu_type=gpu_type, app_name=name[:64], volume=volume, secrets=tuple(secret or ()),
        timeout_hours=timeout_hours, env_presets=tuple(env_preset or ()), overrides=tuple(overrides or ()),
        requirements=tuple(scaletune_requirements(deepspeed=cfg.distributed.strategy in ("auto", "deepspeed"))),
        source=str(config),
    )  # fmt: skip
    dirs = frozenset(p for p in plan.mounts if Path(p).is_dir())
    text = render_modal_app(opts, plan, filename=output.name if output else "modal_app.py", local_dirs=dirs)
    if plan.secret_env_names and not secret:
        typer.echo(
            f"warning: distributed.env names {', '.join(plan.secret_env_names)}: they are not written into the app; "
            "put them in a Modal secret and pass --secret NAME",
            err=True,
        )
    _emit(text, output)


config_app = typer.Typer(help="Standalone DeepSpeed / FSDP configs for other trainers.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("deepspeed")
def config_deepspeed(
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Write the JSON here (default: print it).")] = None,
    zero_stage: Annotated[int, typer.Option(help="ZeRO stage 0-3.")] = 2,
    offload_optimizer: Annotated[bool, typer.Option("--offload-optimizer", help="Optimizer state and step on the CPU.")] = False,
    offload_params: Annotated[bool, typer.Option("--offload-params", help="Parameters on the CPU (ZeRO-3).")] = False,
    bf16: Annotated[bool, typer.Option("--bf16", help="bf16 mixed precision (default: auto).")] = False,
    fp16: Annotated[bool, typer.Option("--fp16", help="fp16 mixed precision with dynamic loss scaling (default: auto).")] = False,
    fp32: Annotated[bool, typer.Option("--fp32", help="No mixed precision (default: auto).")] = False,
    gradient_accumulation_steps: Annotated[Optional[int], typer.Option(help="Default: auto.")] = None,
    gradient_clipping: Annotated[Optional[float], typer.Option(help="Default: auto.")] = None,
    micro_batch_size: Annotated[Optional[int], typer.Option(help="Per-GPU micro batch (default: auto).")] = None,
) -> None:
    """DeepSpeed JSON (`auto` where the Hugging Face Trainer fills the value)."""
    import json

    from scaletune.launch.configs import deepspeed_config

    if bf16 + fp16 + fp32 > 1:
        raise UserError("give at most one of --bf16, --fp16, --fp32", title="invalid deepspeed options")
    precision = "bf16" if bf16 else "fp16" if fp16 else "fp32" if fp32 else "auto"
    cfg = deepspeed_config(zero_stage, offload_optimizer, offload_params, precision, gradient_accumulation_steps,
                           gradient_clipping, micro_batch_size)  # fmt: skip
    text = json.dumps(cfg, indent=2) + "\n"
    _emit(text, output)


@config_app.command("fsdp")
def config_fsdp(
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Write the config here (default: print it).")] = None,
    reshard_after_forward: Annotated[bool, typer.Option("--reshard-after-forward/--no-reshard-after-forward", help="Free gathered parameters after forward (ZeRO-3-like) or keep them (ZeRO-2-like).")] = True,
    mixed_precision: Annotated[str, typer.Option(help="bf16, fp16 or no.")] = "bf16",
    cpu_offload: Annotated[bool, typer.Option("--cpu-offload", help="Parameters, gradients and optimizer state on the CPU.")] = False,
    state_dict_type: Annotated[str, typer.Option(help="Checkpoints: sharded or full.")] = "sharded",
    activation_checkpointing: Annotated[bool, typer.Option("--activation-checkpointing", help="FSDP's own activation checkpointing.")] = False,
    format: Annotated[str, typer.Option("--format", help="trainer (JSON for TrainingArguments.fsdp_config) or accelerate (YAML for accelerate launch).")] = "trainer",
) -> None:
    """FSDP2 config for the Hugging Face Trainer or `accelerate launch`."""
    from scaletune.launch.configs import fsdp_config

    text, _ = fsdp_config(reshard_after_forward, mixed_precision, cpu_offload, state_dict_type,  # type: ignore[arg-type]
                          activation_checkpointing, format)  # type: ignore[arg-type]  # fmt: skip
    _emit(text, output)


@app.command("export")
def export(
    checkpoint: Annotated[Path, typer.Argument(help="A checkpoints/step-N folder, or a run directory (its latest checkpoint).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Folder to write the Hugging Face model to (must be empty).")],
    merge_lora: Annotated[bool, typer.Option("--merge-lora", help="Fold a LoRA adapter into the base weights.")] = False,
    dtype: Annotated[Optional[str], typer.Option(help="Weights dtype: bfloat16, float16 or float32 (default: as trained).")] = None,
    max_shard_size: Annotated[str, typer.Option(help="Largest safetensors file, e.g. 5GB.")] = "5GB",
) -> None:
    """Write a consolidated Hugging Face folder (safetensors) from any checkpoint, sharded or not."""
    from scaletune.checkpoint import export_checkpoint

    if dtype is not None and dtype not in ("bfloat16", "float16", "float32", "bf16", "fp16", "fp32"):
        raise UserError(f"--dtype {dtype}: use bfloat16, float16 or float32", title="invalid arguments")
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype or "", dtype)
    out = export_checkpoint(checkpoint, output, merge_lora=merge_lora, dtype=dtype, max_shard_size=max_shard_size)
    typer.echo(str(out))


# ---------------------------------------------------------------------------------------------
# Planning and checking (issue 5): thin wrappers over scaletune.plan and scaletune.doctor.


@app.command(context_settings={"allow_interspersed_args": True})
def plan(
    config: Annotated[Path, typer.Argument(help="YAML config (model.name_or_path may be a preset name such as llama-3-8b).")],
    overrides: Annotated[Optional[list[str]], typer.Argument(help="Dotted overrides.")] = None,
    gpus: Annotated[Optional[int], typer.Option(help="GPUs per node (default: the GPUs visible here).")] = None,
    gpu_memory: Annotated[Optional[float], typer.Option(help="Memory per GPU in GiB (default: the first visible GPU's).")] = None,
    nodes: Annotated[int, typer.Option(help="Number of nodes.")] = 1,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON for machines.")] = False,
    simulate_world_size: Annotated[Optional[int], typer.Option(help="Also shard the meta model with FSDP2 over a fake process group of W ranks and report rank 0's shard.")] = None,
) -> None:
    """Memory per rank of every strategy (parameters, gradients, optimizer state, activations) and
    the chosen strategy, from the model's config alone (meta device, no weights)."""
    import json

    from rich.console import Console

    from scaletune.config import load_config
    from scaletune.plan import cli_plan, describe_shape, render_table, simulate_fsdp

    cfg = load_config(config, overrides or [])
    result, note = cli_plan(cfg, gpus=gpus, gpu_memory_gib=gpu_memory, nodes=nodes)
    sim = simulate_fsdp(cfg, simulate_world_size) if simulate_world_size else None
    if json_out:
        data = result.to_json()
        if sim is not None:
            data["simulation"] = {**sim, "planned_fsdp_params_bytes": _fsdp_params(cfg, simulate_world_size)}
        typer.echo(json.dumps(data, indent=2))
        return
    console = Console(width=None if sys.stdout.isatty() else 160)
    assert result.shape is not None
    console.print(describe_shape(result.shape))
    console.print(note)
    console.print(render_table(result))
    console.print(f"chosen: [bold]{result.chosen}[/] - {result.reason}")
    if sim is not None:
        planned = _fsdp_params(cfg, simulate_world_size)
        console.print(
            f"simulated fsdp over a fake process group of {sim['world_size']} ranks in {sim['seconds']} s: rank 0 holds "
            f"{sim['params_bytes']:,} parameter bytes in {sim['tensors']} shards (plan: {planned:,}; full model {sim['full_bytes']:,})"
        )


def _fsdp_params(cfg, world_size: int) -> int:
    from scaletune.plan import plan as make_plan

    return make_plan(cfg, world_size=world_size, gpu_memory_bytes=None).get("fsdp").params


@app.command()
def doctor(
    comm_test: Annotated[bool, typer.Option("--comm-test", help="Run all_reduce / all_gather / reduce_scatter across the launched ranks (under torchrun).")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON for machines.")] = False,
    config: Annotated[Optional[Path], typer.Option(help="Also run the checks that need a config.")] = None,
) -> None:
    """Environment report and checks, each OK / WARN / FAIL with the fix. Exits 1 when a check fails."""
    import json

    from rich.console import Console

    from scaletune.config import load_config
    from scaletune.doctor import checks, comm_test as run_comm_test, render, render_comm, report
    from scaletune.env import DistributedEnv

    env = DistributedEnv.from_environ()
    cfg = load_config(config) if config is not None else None
    rep, results = report(env), checks(cfg, env)
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


def main(argv: list[str] | None = None) -> None:
    """Console entry point. Usage errors exit 2 (click's standalone mode); a UserError raised by a
    verb exits 2 with every problem and no traceback; anything else exits 1 with the traceback."""
    try:
        app(args=argv, standalone_mode=True)
    except UserError as exc:
        typer.echo(f"error: {exc.format()}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
