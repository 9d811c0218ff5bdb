"""sbatch scripts that run one config across SLURM nodes: options in, script text out.

The script (see :func:`render_sbatch`):

* has `#SBATCH` lines with literal, double-quoted values only (sbatch never expands shell
  variables there, so none are written);
* finds the master as the first host of `scontrol show hostnames "$SLURM_JOB_NODELIST"`,
  picks a free TCP port there, and starts one `srun` task per node; each task runs torchrun,
  which starts that node's ranks and joins the c10d rendezvous at MASTER_ADDR:MASTER_PORT;
* works on CPU-only nodes (`gpus_per_node=0, procs_per_node=P`);
* quotes every value (`shlex.quote`), so paths with spaces, quotes or `$(...)` stay inert;
* never contains secrets: sbatch passes the submitting environment to the job (its default
  `--export=ALL`) and srun passes it on to every node.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from scaletune.errors import Problem, UserError
from scaletune.launch import commands
from scaletune.launch.commands import nproc_problems, torchrun_argv, train_argv
from scaletune.launch.presets import env_name_problems, merged_env, preset_problems, split_secrets
from scaletune.launch.shell import Raw, secret_passthrough_lines, shell_join

_TIME = re.compile(
    r"^(?:(?P<days>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)$"
)
_MEM = re.compile(r"^\d+[KMGT]?$", re.IGNORECASE)


def _option(message: str, fix: str = "") -> Problem:
    """A problem with an sbatch option (a command-line flag: no config key)."""
    return Problem("slurm options", None, message, fix)


def time_problems(value: str | None) -> list[Problem]:
    """Problems with a SLURM time limit. Accepted, as sbatch documents them: `M`, `M:S`,
    `H:M:S`, `D-H`, `D-H:M`, `D-H:M:S`, `UNLIMITED`/`INFINITE`; minutes and seconds after a
    colon must be below 60 (sbatch silently carries them over, which hides typos)."""
    if value is None:
        return []
    v = value.strip()
    if v.upper() in ("UNLIMITED", "INFINITE"):
        return []
    m = _TIME.match(v)
    if not m:
        return [
            _option(
                f"--time {value!r} is not a SLURM time limit",
                "use MINUTES, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED",
            )
        ]
    g = m.groupdict()
    if g["days"] is not None:
        if int(g["dh"]) > 23:
            return [_option(f"--time {value!r}: hours after 'D-' must be below 24")]
        below60 = [x for x in (g["dm"], g["ds"]) if x is not None]
    else:
        parts = [x for x in (g["a"], g["b"], g["c"]) if x is not None]
        below60 = parts[1:]
        if all(int(x) == 0 for x in parts):
            return [_option(f"--time {value!r} is zero", "give a positive limit or UNLIMITED")]
    if any(int(x) >= 60 for x in below60):
        return [_option(f"--time {value!r}: minutes and seconds must be below 60")]
    return []


def _sbatch_value_problems(name: str, value: str | None) -> list[Problem]:
    if value is None:
        return []
    if value == "" or any(c in value for c in '"\\\n\r\x00'):
        return [_option(f"--{name} {value!r}: empty, or contains a double quote, backslash or line break")]
    return []


@dataclass(frozen=True)
class SlurmOptions:
    config: str
    nodes: int
    gpus_per_node: int | None
    overrides: tuple[str, ...] = ()
    procs_per_node: int | None = None
    cpus_per_task: int | None = None
    mem_per_gpu: str | None = None
    mem: str | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str = "scaletune"
    output: str = "%x-%j.out"
    env_presets: tuple[str, ...] = ()
    config_env: dict[str, str] = field(default_factory=dict)
    secret_env: tuple[str, ...] = ()  # distributed.secret_env of the config
    max_restarts: int = 0
    python: str = "python"
    workdir: str | None = None  # absolute; the job runs there (`#SBATCH --chdir`)
    extra_sbatch: tuple[str, ...] = ()  # further `--opt=value` lines, written quoted
    # What each rank runs after torchrun's options; default `-m scaletune train CONFIG ...`.
    program: tuple[str, ...] | None = None


def validate(opts: SlurmOptions) -> None:
    """Raises UserError naming every problem."""
    p: list[Problem] = []
    if opts.nodes < 1:
        p.append(_option(f"--nodes must be 1 or more, got {opts.nodes}"))
    if opts.gpus_per_node is None:
        p.append(_option("--gpus-per-node is required (0 for CPU nodes, with --procs-per-node)"))
    else:
        p += nproc_problems(opts.gpus_per_node, opts.procs_per_node)
    if opts.cpus_per_task is not None and opts.cpus_per_task < 1:
        p.append(_option(f"--cpus-per-task must be 1 or more, got {opts.cpus_per_task}"))
    if opts.mem_per_gpu is not None:
        if not _MEM.match(opts.mem_per_gpu):
            p.append(_option(f"--mem-per-gpu {opts.mem_per_gpu!r} is not a SLURM memory size (e.g. 80G, 81920M)"))
        if not opts.gpus_per_node:
            p.append(_option("--mem-per-gpu needs GPUs; on CPU nodes use --mem"))
        if opts.mem is not None:
            p.append(_option("give --mem-per-gpu or --mem, not both"))
    if opts.mem is not None and not _MEM.match(opts.mem):
        p.append(_option(f"--mem {opts.mem!r} is not a SLURM memory size (e.g. 64G)"))
    p += time_problems(opts.time)
    if opts.max_restarts < 0:
        p.append(_option(f"--max-restarts must be 0 or more, got {opts.max_restarts}"))
    for name in ("partition", "account", "job_name", "output", "workdir"):
        p += _sbatch_value_problems(name.replace("_", "-"), getattr(opts, name))
    for extra in opts.extra_sbatch:
        if not re.match(r"^--[a-z][a-z-]*(=.*)?$", extra):
            p.append(_option(f"--sbatch {extra!r} must look like --option=value"))
        else:
            p += _sbatch_value_problems("sbatch", extra.partition("=")[2] or "x")
    p += preset_problems(opts.env_presets)
    p += env_name_problems(opts.config_env, "distributed.env")
    if p:
        raise UserError(p, title="invalid slurm options")


def ranks_per_node(opts: SlurmOptions) -> int:
    """Ranks each node of the job starts (validated options: never unknown)."""
    ranks = commands.ranks_per_node(opts.gpus_per_node, opts.procs_per_node)
    assert ranks is not None, "validate() requires gpus_per_node or procs_per_node"
    return ranks


def sbatch_directives(opts: SlurmOptions) -> list[tuple[str, str]]:
    """(option, literal value) pairs of the `#SBATCH` lines, in order."""
    cpus = opts.cpus_per_task if opts.cpus_per_task is not None else ranks_per_node(opts)
    d: list[tuple[str, str]] = [("job-name", opts.job_name), ("nodes", str(opts.nodes)), ("ntasks-per-node", "1")]
    if opts.gpus_per_node:
        d.append(("gpus-per-node", str(opts.gpus_per_node)))
    d.append(("cpus-per-task", str(cpus)))
    if opts.mem_per_gpu:
        d.append(("mem-per-gpu", opts.mem_per_gpu))
    if opts.mem:
        d.append(("mem", opts.mem))
    if opts.time:
        d.append(("time", opts.time.strip()))
    if opts.partition:
        d.append(("partition", opts.partition))
    if opts.account:
        d.append(("account", opts.account))
    if opts.workdir:
        d.append(("chdir", opts.workdir))
    d.append(("output", opts.output))
    for extra in opts.extra_sbatch:
        k, _, v = extra[2:].partition("=")
        d.append((k, v))
    return d


def render_sbatch(opts: SlurmOptions) -> str:
    """The sbatch script text. Comments carry no user text (a newline in it would start a command);
    `#SBATCH` values are validated literals; every other value is `shlex`-quoted.

    Raises:
        UserError: invalid options (every problem at once), unknown env preset.
    """
    validate(opts)
    env = merged_env(opts.config_env, opts.env_presets)
    public, secrets = split_secrets(env, opts.secret_env)
    nproc = ranks_per_node(opts)
    cpus = opts.cpus_per_task if opts.cpus_per_task is not None else nproc
    world = nproc * opts.nodes
    kind = f"{opts.gpus_per_node} GPU(s)" if opts.gpus_per_node else "no GPU (CPU ranks)"

    lines = ["#!/bin/bash", "# Written by `scaletune slurm`."]
    lines += [
        f"# {opts.nodes} node(s) x {nproc} rank(s) = world size {world}; each node: {kind}.",
        "# One srun task per node runs torchrun, which starts that node's ranks; all nodes meet",
        "# in a c10d rendezvous on the first node. Submit with: sbatch THIS_FILE",
    ]
    lines += [f'#SBATCH --{k}="{v}"' for k, v in sbatch_directives(opts)]
    lines += [
        "set -euo pipefail",
        "",
        "# The interpreter that has scaletune installed (the one that wrote this script).",
        f"PYTHON={shlex.quote(opts.python)}",
    ]
    if public:
        lines += ["", "# Environment: distributed.env from the config, then --env-preset (later wins)."]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in public.items()]
    if not opts.gpus_per_node:
        threads = max(1, cpus // max(1, nproc))
        lines += [
            "# CPU ranks: share this task's cores between them (torchrun would set 1).",
            f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-{threads}}}"',
        ]
    if secrets:
        lines += [
            "",
            "# sbatch hands the submitting shell's environment to the job (--export=ALL, its default)",
            "# and srun hands it to every node, so secrets travel that way and are never written here.",
        ]
        lines += secret_passthrough_lines(secrets, header=False)
    lines += [
        "",
        "# The first node of the allocation is the master; this batch step runs there.",
        "# (`|| true`: with pipefail, scontrol may get SIGPIPE once head has its line on long node lists.)",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1 || true)"',
        '[ -n "$MASTER_ADDR" ] || { echo "scaletune: no node in SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST" >&2; exit 1; }',
        "# A free TCP port on it for the rendezvous.",
        'MASTER_PORT="$("$PYTHON" -c \'import socket; s = socket.socket(); s.bind(("", 0)); '
        "print(s.getsockname()[1]); s.close()')\"",
        "export MASTER_ADDR MASTER_PORT",
        'echo "scaletune: job $SLURM_JOB_ID, $SLURM_JOB_NUM_NODES node(s), rendezvous at '
        '$MASTER_ADDR:$MASTER_PORT" >&2',
        "",
        "# One task per node (--kill-on-bad-exit: a failing node stops the others).",
    ]
    srun = [
        "srun",
        Raw('--nodes="$SLURM_JOB_NUM_NODES"'),
        "--ntasks-per-node=1",
        f"--cpus-per-task={cpus}",
        "--kill-on-bad-exit=1",
    ]
    program = list(opts.program) if opts.program else train_argv(opts.config, opts.overrides, opts.secret_env)
    torchrun = torchrun_argv(
        Raw('"$PYTHON"'),
        nproc,
        [],
        nnodes=Raw('"$SLURM_JOB_NUM_NODES"'),
        rdzv_endpoint=Raw('"$MASTER_ADDR:$MASTER_PORT"'),
        rdzv_id=Raw('"scaletune-$SLURM_JOB_ID"'),
        max_restarts=opts.max_restarts,
    )
    lines.append(" \\\n    ".join(shell_join(part) for part in (srun, torchrun, program)))
    return "\n".join(lines) + "\n"


_JOB_ID = re.compile(r"^(\d+)(?:;.*)?$")


def submit(
    script_path: str,
    sbatch: str = "sbatch",
    env: dict[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> str:
    """`sbatch --parsable SCRIPT`; returns the job id. sbatch hands its environment to the job
    (`--export=ALL`): `environ` (default: this process's) plus `env`, how secret values reach the
    ranks. The job service passes an `environ` without its own secrets.

    Raises:
        UserError: sbatch is missing or refused the script (its message included).
    """
    try:
        full_env = {**(os.environ if environ is None else environ), **(env or {})}
        res = subprocess.run(
            [sbatch, "--parsable", script_path], capture_output=True, text=True, timeout=120, env=full_env
        )
    except FileNotFoundError:
        raise UserError(
            f"{sbatch} not found: submit from a SLURM login node, or drop --submit", title="cannot submit"
        ) from None
    out = res.stdout.strip().splitlines()
    m = _JOB_ID.match(out[-1].strip()) if out else None
    if res.returncode != 0 or not m:
        msg = (res.stderr or res.stdout).strip() or f"exit code {res.returncode}"
        raise UserError(f"sbatch refused {script_path}: {msg}", title="cannot submit")
    return m.group(1)
