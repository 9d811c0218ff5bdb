"""Verbs that start runs elsewhere: `launch` (torchrun / deepspeed launcher), `slurm`, `modal`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from scaletune.cli.app import EnvPresetOpt, app, emit, output_file, resolved


@app.command(context_settings={"allow_interspersed_args": True})
def launch(
    config: Annotated[Path, typer.Argument(help="YAML config.")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides passed to every rank.")] = None,
    nodes: Annotated[int, typer.Option(help="Number of nodes in the job.")] = 1,
    gpus_per_node: Annotated[
        int | None, typer.Option(help="GPUs per node (default: all visible); 0 for CPU nodes.")
    ] = None,
    procs_per_node: Annotated[
        int | None, typer.Option(help="Ranks per node (CPU nodes; default: the GPU count).")
    ] = None,
    node_rank: Annotated[int, typer.Option(help="This node's index, 0..nodes-1 (0 hosts the rendezvous).")] = 0,
    master_addr: Annotated[str | None, typer.Option(help="Address of node 0, reachable from every node.")] = None,
    master_port: Annotated[
        int | None, typer.Option(help="Rendezvous port on node 0 (default 29500; one node: a free port).")
    ] = None,
    launcher: Annotated[str, typer.Option(help="torchrun or deepspeed.")] = "torchrun",
    max_restarts: Annotated[int, typer.Option(help="torchrun: restart the workers up to K times after a failure.")] = 0,
    rdzv_id: Annotated[
        str | None, typer.Option(help="Rendezvous id, the same on every node (default: scaletune-PORT).")
    ] = None,
    env_preset: EnvPresetOpt = None,
    python: Annotated[str, typer.Option(help="Interpreter with scaletune installed, on every node.")] = sys.executable,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the command and its environment; run nothing.")
    ] = False,
    script: Annotated[
        Path | None, typer.Option(help="Write a runnable shell script for this node instead of running.")
    ] = None,
) -> None:
    """Build the torchrun (or deepspeed launcher) command for this node and run it.

    Example: `scaletune launch examples/quickstart.yaml --dry-run`
    """
    import os
    import tempfile

    from scaletune.launch.commands import LaunchOptions, build_launch, ranks_per_node

    output_file(script, "--script")
    per_node = ranks_per_node(gpus_per_node, procs_per_node)
    spec = resolved(config, overrides, world_size=nodes * per_node if per_node else None)
    cfg = spec.config
    opts = LaunchOptions(
        config=str(config),
        overrides=tuple(overrides or ()),
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        procs_per_node=procs_per_node,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        launcher=launcher,
        max_restarts=max_restarts,
        rdzv_id=rdzv_id,
        env_presets=tuple(env_preset or ()),
        config_env=dict(cfg.distributed.env),
        secret_env=tuple(cfg.distributed.secret_env),
        config_num_processes=cfg.distributed.num_processes,
        python=python,
    )
    if dry_run or script is not None:
        cmd = build_launch(opts)
        if script is not None:
            script.write_text(cmd.script(workdir=os.getcwd()))
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
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides passed to every rank.")] = None,
    nodes: Annotated[int, typer.Option(help="Number of nodes.")] = 1,
    gpus_per_node: Annotated[
        int | None, typer.Option(help="GPUs per node (required); 0 for CPU nodes, with --procs-per-node.")
    ] = None,
    procs_per_node: Annotated[int | None, typer.Option(help="Ranks per node (default: the GPU count).")] = None,
    cpus_per_task: Annotated[
        int | None, typer.Option(help="CPU cores per node for the ranks (default: one per rank).")
    ] = None,
    mem_per_gpu: Annotated[str | None, typer.Option(help="Memory per GPU, e.g. 80G.")] = None,
    mem: Annotated[str | None, typer.Option(help="Memory per node, e.g. 64G (instead of --mem-per-gpu).")] = None,
    time: Annotated[str | None, typer.Option(help="Time limit: MINUTES, HH:MM:SS, D-HH:MM:SS or UNLIMITED.")] = None,
    partition: Annotated[str | None, typer.Option(help="SLURM partition.")] = None,
    account: Annotated[str | None, typer.Option(help="SLURM account.")] = None,
    job_name: Annotated[str, typer.Option(help="Job name.")] = "scaletune",
    log: Annotated[
        str, typer.Option(help="Job log file (sbatch --output pattern, relative to the working directory).")
    ] = "%x-%j.out",
    max_restarts: Annotated[int, typer.Option(help="torchrun restarts of the workers after a failure.")] = 0,
    env_preset: EnvPresetOpt = None,
    python: Annotated[str, typer.Option(help="Interpreter with scaletune installed on the nodes.")] = sys.executable,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write the script here (default: print it).")
    ] = None,
    submit: Annotated[bool, typer.Option("--submit", help="Hand the script to sbatch and print the job id.")] = False,
) -> None:
    """Write an sbatch script that runs the config across the nodes (one torchrun per node).

    Example: `scaletune slurm my.yaml --nodes 2 --gpus-per-node 8 -o job.sbatch`
    """
    import os

    from scaletune.launch.commands import ranks_per_node
    from scaletune.launch.slurm import SlurmOptions, render_sbatch
    from scaletune.launch.slurm import submit as sbatch_submit

    output_file(output, "-o/--output")
    per_node = ranks_per_node(gpus_per_node, procs_per_node)
    cfg = resolved(config, overrides, world_size=nodes * per_node if per_node else None).config
    text = render_sbatch(
        SlurmOptions(
            config=str(config),
            overrides=tuple(overrides or ()),
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            procs_per_node=procs_per_node,
            cpus_per_task=cpus_per_task,
            mem_per_gpu=mem_per_gpu,
            mem=mem,
            time=time,
            partition=partition,
            account=account,
            job_name=job_name,
            output=log,
            env_presets=tuple(env_preset or ()),
            config_env=dict(cfg.distributed.env),
            secret_env=tuple(cfg.distributed.secret_env),
            max_restarts=max_restarts,
            python=python,
            workdir=os.getcwd(),
        )
    )
    if output is None and submit:
        output = Path(f"{job_name}.sbatch")
    if output is None:
        typer.echo(text, nl=False)
        return
    output.write_text(text)
    output.chmod(0o755)
    from scaletune.launch.presets import merged_env, split_secrets

    secrets = split_secrets(merged_env(cfg.distributed.env), cfg.distributed.secret_env)[1]
    if submit:
        # sbatch hands its environment to the job (--export=ALL): the secrets travel that way.
        values = {k: v for k, v in cfg.distributed.env.items() if k in secrets}
        typer.echo(sbatch_submit(str(output), env=values))
    else:
        typer.echo(str(output))
        if secrets:
            typer.echo(
                f"note: export {', '.join(secrets)} in the shell that runs sbatch (secrets are not written into the script)",
                err=True,
            )


@app.command(context_settings={"allow_interspersed_args": True})
def modal(
    config: Annotated[Path, typer.Argument(help="YAML config.")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Dotted overrides, applied to the embedded config.")
    ] = None,
    gpu_count: Annotated[int, typer.Option(help="GPUs in the container (1-8); more than 1 runs torchrun.")] = 1,
    gpu_type: Annotated[str, typer.Option(help="Modal GPU type: H100, A100-80GB, L40S, ...")] = "H100",
    app_name: Annotated[str | None, typer.Option(help="Modal app name (default: scaletune-CONFIGNAME).")] = None,
    volume: Annotated[str, typer.Option(help="Modal volume for the run directory.")] = "scaletune-runs",
    secret: Annotated[
        list[str] | None, typer.Option("--secret", help="Modal secret to attach (e.g. huggingface), repeatable.")
    ] = None,
    timeout_hours: Annotated[float, typer.Option(help="Function timeout in hours (Modal allows up to 24).")] = 24.0,
    env_preset: EnvPresetOpt = None,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write the app here (default: print it).")
    ] = None,
) -> None:
    """Write a Modal app that runs the config on Modal GPUs.

    Example: `scaletune modal my.yaml --gpu-count 8 --gpu-type H100 -o app.py`
    """
    import re

    from scaletune.config import load_config
    from scaletune.launch.modal_app import ModalOptions, image_requirements, plan_inputs, render_modal_app

    output_file(output, "-o/--output")
    resolved(config, overrides, world_size=gpu_count if gpu_count > 0 else None)  # every problem, before writing
    cfg = load_config(config, overrides or [])  # as written: `auto` is decided on Modal's GPUs
    plan = plan_inputs(cfg.model_dump(mode="json"), Path.cwd())
    name = app_name or "scaletune-" + (re.sub(r"[^A-Za-z0-9._-]+", "-", config.stem).strip("-.") or "run")
    opts = ModalOptions(
        gpu_count=gpu_count,
        gpu_type=gpu_type,
        app_name=name[:64],
        volume=volume,
        secrets=tuple(secret or ()),
        timeout_hours=timeout_hours,
        env_presets=tuple(env_preset or ()),
        requirements=image_requirements(cfg.distributed.strategy),
    )
    dirs = frozenset(p for p in plan.mounts if Path(p).is_dir())
    text = render_modal_app(opts, plan, local_dirs=dirs)
    if plan.secret_env_names and not secret:
        typer.echo(
            f"warning: distributed.env names {', '.join(plan.secret_env_names)}: they are not written into the app; "
            "put them in a Modal secret and pass --secret NAME",
            err=True,
        )
    emit(text, output)
