"""Launch commands for torchrun and the deepspeed launcher: options in, argv + environment out.

Pure functions, no torch import (DESIGN.md): tests compare their output. The command line
(`scaletune launch`) executes the result; `--dry-run` prints it; `--script` writes it as a
commented shell script.

Every rank runs `python -m scaletune train CONFIG [overrides]`. The launchers:

* torchrun (`python -m torch.distributed.run`, same interpreter as the caller):
  one node `--standalone` (or c10d on 127.0.0.1:PORT when a port is given); several nodes
  c10d rendezvous at MASTER_ADDR:PORT, node 0 hosting the rendezvous store;
  `--max-restarts K` restarts all local workers when one fails.
* deepspeed (`python -m deepspeed.launcher.runner`): one node `--num_gpus G`; several nodes
  `--no_ssh --node_rank R` with a hostfile listing N nodes (each node runs the launcher itself).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from scaletune.config.overrides import public_overrides
from scaletune.errors import Problem, UserError
from scaletune.launch.presets import env_name_problems, merged_env, preset_problems, split_secrets
from scaletune.launch.shell import Raw, secret_passthrough_lines, shell_join

LauncherName = Literal["torchrun", "deepspeed"]
LAUNCHERS = ("torchrun", "deepspeed")
DEFAULT_MASTER_PORT = 29500
TORCHRUN_MODULE = "torch.distributed.run"
DEEPSPEED_MODULE = "deepspeed.launcher.runner"


def train_argv(config: str, overrides: Sequence[str] = (), secret_env: Sequence[str] = ()) -> list[str]:
    """The arguments after `python`: `-m scaletune train CONFIG [overrides]`, without the overrides
    that set a secret (its value reaches the ranks through their environment, never the argv)."""
    return ["-m", "scaletune", "train", str(config), *public_overrides(list(map(str, overrides)), secret_env)]


def endpoint(addr: str, port: int | str) -> str:
    """`host:port`, IPv6 addresses in brackets."""
    if ":" in addr and not addr.startswith("["):
        addr = f"[{addr}]"
    return f"{addr}:{port}"


def torchrun_argv(
    python: str,
    nproc_per_node: int | str,
    program: Sequence[str],
    *,
    nnodes: int | str = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    node_rank: int | None = None,
    is_host: bool | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """THE torchrun command line (`python -m torch.distributed.run`), used by the trainer's
    re-exec, `scaletune launch` and the sbatch script.

    Args:
        python: the interpreter (a :class:`Raw` shell fragment in scripts, e.g. `"$PYTHON"`).
        nproc_per_node: ranks per node, or `gpu` (all visible GPUs).
        program: what each rank runs after torchrun's options (`-m scaletune train CONFIG ...`).
        nnodes: nodes in the job (a :class:`Raw` fragment in sbatch scripts).
        rdzv_endpoint: `host:port` of the c10d rendezvous; None: `--standalone` (one node, a free port).
        rdzv_id: the rendezvous id, the same on every node.
        node_rank: this node's index, where the launch is per node.
        is_host: whether this node hosts the rendezvous store (several nodes on one machine need it said).
        max_restarts: restarts of the worker group after a failure.
    """
    argv = [python, "-m", TORCHRUN_MODULE]
    if rdzv_endpoint is None:
        argv += ["--standalone", "--nnodes", "1"]
    else:
        argv += ["--nnodes", nnodes if isinstance(nnodes, Raw) else str(nnodes)]
        if node_rank is not None:
            argv += ["--node-rank", str(node_rank)]
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id or "scaletune"]
        if is_host is not None:
            argv += ["--rdzv-conf", f"is_host={1 if is_host else 0}"]
    argv += ["--nproc-per-node", str(nproc_per_node)]
    if max_restarts:
        argv += ["--max-restarts", str(max_restarts)]
    return argv + list(program)


def single_node_torchrun_argv(
    python_executable: str,
    nproc_per_node: int,
    train_args: Sequence[str],
    master_port: int | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """torchrun on this machine with `nproc_per_node` ranks, each running `scaletune train`.

    Used by the trainer to re-execute itself (`distributed.num_processes: N`).

    Args:
        python_executable: the interpreter (`sys.executable`); torchrun runs as its module.
        nproc_per_node: ranks to start (>= 1).
        train_args: the arguments of `scaletune train`: CONFIG then the overrides.
        master_port: None lets torchrun pick a free port (`--standalone`); else c10d on
            127.0.0.1:PORT.
        max_restarts: torchrun restarts of the worker group after a failure.

    Example:
        ``single_node_torchrun_argv("/venv/bin/python", 2, ["cfg.yaml", "seed=1"])`` ->
        ``[/venv/bin/python, -m, torch.distributed.run, --standalone, --nnodes, 1,
        --nproc-per-node, 2, -m, scaletune, train, cfg.yaml, seed=1]``

    Raises:
        UserError: nproc_per_node < 1, a port outside 1-65535, max_restarts < 0.
    """
    problems = []
    if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        problems.append(_option(f"the number of processes must be a positive integer, got {nproc_per_node!r}"))
    problems += _port_problems(master_port, "master port")
    if max_restarts < 0:
        problems.append(_option(f"max restarts must be 0 or more, got {max_restarts}"))
    if problems:
        raise UserError(problems, title="invalid launch options")
    return torchrun_argv(
        python_executable,
        nproc_per_node,
        ["-m", "scaletune", "train", *train_args],
        rdzv_endpoint=None if master_port is None else endpoint("127.0.0.1", master_port),
        rdzv_id=None if master_port is None else f"scaletune-{master_port}",
        max_restarts=max_restarts,
    )


@dataclass(frozen=True)
class LaunchOptions:
    """What `scaletune launch` was asked for (one node's view of the job).

    `gpus_per_node=None` means "all GPUs this node has" (torchrun `--nproc-per-node gpu`; the
    deepspeed launcher's default). CPU nodes: `gpus_per_node=0, procs_per_node=P`.
    """

    config: str
    overrides: tuple[str, ...] = ()
    nodes: int = 1
    gpus_per_node: int | None = None
    procs_per_node: int | None = None
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = "torchrun"
    max_restarts: int = 0
    rdzv_id: str | None = None
    env_presets: tuple[str, ...] = ()
    config_env: dict[str, str] = field(default_factory=dict)  # distributed.env of the config
    secret_env: tuple[str, ...] = ()  # distributed.secret_env of the config
    # distributed.num_processes of the config: ranks per node when neither --gpus-per-node nor
    # --procs-per-node is given and it is a number (`auto`: one rank per visible GPU).
    config_num_processes: int | str = "auto"
    python: str = "python"
    hostfile: str | None = None  # deepspeed, several nodes: where the hostfile is written
    # What each rank runs after the launcher's options; default `-m scaletune train CONFIG ...`.
    # Other programs (a communication test, a smoke-test script) launch the same way.
    program: tuple[str, ...] | None = None


@dataclass(frozen=True)
class LaunchCommand:
    """The launch of one node.

    Attributes:
        argv: the command; execute with `env` added to the caller's environment.
        env: variables to set (`distributed.env`, then presets), secrets included.
        secret_names: names in `env` that look like credentials: never written into scripts.
        files: path -> text of files the command needs (the deepspeed hostfile).
        role: "master" (node 0) or "worker".
        summary: one line describing the job.
    """

    argv: list[str]
    env: dict[str, str]
    secret_names: list[str]
    files: dict[str, str]
    role: str
    summary: str

    @property
    def public_env(self) -> dict[str, str]:
        return {k: v for k, v in self.env.items() if k not in self.secret_names}

    def shell_command(self) -> str:
        return shell_join(self.argv)

    def dry_run_text(self) -> str:
        """What `--dry-run` prints: the environment as `export` lines, then the command."""
        lines = [f"# {self.summary}"]
        for k, v in self.public_env.items():
            lines.append(f"export {k}={shlex.quote(v)}")
        for k in self.secret_names:
            lines.append(f"# {k}: secret, taken from the caller's environment (value not shown)")
        for path, text in self.files.items():
            lines.append(f"# writes {path}:")
            lines += [f"#   {line}" for line in text.splitlines()]
        lines.append(self.shell_command())
        return "\n".join(lines) + "\n"

    def script(self, workdir: str | None) -> str:
        """A runnable, commented shell script for this node (`scaletune launch --script FILE`),
        `cd`-ing into `workdir` first when given. Comments carry no user text (a newline in it would
        start a command); every value is quoted; secrets are passed through, never written."""
        lines = ["#!/usr/bin/env bash", "# Written by `scaletune launch`."]
        lines += [
            f"# {self.summary}.",
            "# Run the script of each node on that node (node 0, the master, hosts the rendezvous;",
            "# workers wait for it up to the rendezvous timeout).",
            "set -euo pipefail",
        ]
        if workdir:
            lines += ["# Relative paths in the config are relative to this directory.", f"cd {shlex.quote(workdir)}"]
        if self.public_env:
            lines.append("# Environment: distributed.env from the config, then --env-preset (later wins).")
            lines += [f"export {k}={shlex.quote(v)}" for k, v in self.public_env.items()]
        lines += secret_passthrough_lines(self.secret_names)
        replace: dict[str, Raw] = {}
        for i, (path, text) in enumerate(self.files.items()):
            var = f"SCALETUNE_FILE_{i}"
            lines.append(f'{var}="$(mktemp)"')
            lines.append(f"cat >\"${var}\" <<'SCALETUNE_EOF'\n{text.rstrip()}\nSCALETUNE_EOF")
            replace[path] = Raw(f'"${var}"')
        argv = [replace.get(t, t) if not isinstance(t, Raw) else t for t in self.argv]
        lines.append(shell_join(argv))
        return "\n".join(lines) + "\n"


_HOST = re.compile(r"^[A-Za-z0-9_.:\[\]%-]+$")


def _option(message: str) -> Problem:
    """A problem with a launch option (a command-line flag: no config key)."""
    return Problem("launch options", None, message)


def _port_problems(port: int | None, what: str) -> list[Problem]:
    if port is None:
        return []
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        return [_option(f"{what} must be between 1 and 65535, got {port!r}")]
    return []


def nproc_problems(gpus_per_node: int | None, procs_per_node: int | None) -> list[Problem]:
    """Problems with `--gpus-per-node G` / `--procs-per-node P` (None: not given)."""
    out = []
    if gpus_per_node is not None and gpus_per_node < 0:
        out.append(_option(f"--gpus-per-node must be 0 or more, got {gpus_per_node}"))
    if procs_per_node is not None and procs_per_node < 1:
        out.append(_option(f"--procs-per-node must be 1 or more, got {procs_per_node}"))
    if gpus_per_node == 0 and procs_per_node is None:
        out.append(_option("--gpus-per-node 0 (CPU nodes) needs --procs-per-node P: how many ranks to start per node"))
    if gpus_per_node and procs_per_node and procs_per_node > gpus_per_node:
        out.append(
            _option(
                f"--procs-per-node {procs_per_node} is more than --gpus-per-node {gpus_per_node}: "
                "ranks would share a GPU"
            )
        )
    return out


def ranks_per_node(gpus_per_node: int | None, procs_per_node: int | None) -> int | None:
    """Ranks each node starts: `--procs-per-node` P where given, else one per GPU (G), else None
    (not known here: one per visible GPU on the node). The one rule for launch, sbatch and serve."""
    if procs_per_node is not None:
        return procs_per_node
    return gpus_per_node or None


def nproc_per_node(gpus_per_node: int | None, procs_per_node: int | None) -> str:
    """torchrun's `--nproc-per-node` value: :func:`ranks_per_node`, else `gpu` (all visible GPUs)."""
    ranks = ranks_per_node(gpus_per_node, procs_per_node)
    return "gpu" if ranks is None else str(ranks)


def validate(opts: LaunchOptions) -> None:
    """Every problem with the options at once.

    Raises:
        UserError: listing each problem.
    """
    p: list[Problem] = []
    if opts.launcher not in LAUNCHERS:
        p.append(_option(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {opts.launcher!r}"))
    if opts.nodes < 1:
        p.append(_option(f"--nodes must be 1 or more, got {opts.nodes}"))
    elif not 0 <= opts.node_rank < opts.nodes:
        p.append(_option(f"--node-rank {opts.node_rank} is outside 0..{opts.nodes - 1} (--nodes {opts.nodes})"))
    p += _port_problems(opts.master_port, "--master-port")
    p += nproc_problems(opts.gpus_per_node, opts.procs_per_node)
    if opts.max_restarts < 0:
        p.append(_option(f"--max-restarts must be 0 or more, got {opts.max_restarts}"))
    if opts.nodes > 1 and not opts.master_addr:
        p.append(_option(f"--nodes {opts.nodes} needs --master-addr: the address of node 0 that every node can reach"))
    if opts.master_addr is not None and not _HOST.match(opts.master_addr):
        p.append(_option(f"--master-addr {opts.master_addr!r} is not a host name or IP address"))
    if opts.rdzv_id is not None and not re.match(r"^[A-Za-z0-9_.-]+$", opts.rdzv_id):
        p.append(_option(f"--rdzv-id {opts.rdzv_id!r} may contain only letters, digits, '.', '_' and '-'"))
    if opts.launcher == "deepspeed" and opts.max_restarts:
        p.append(_option("--max-restarts needs --launcher torchrun (the deepspeed launcher does not restart workers)"))
    p += preset_problems(opts.env_presets)
    p += env_name_problems(opts.config_env, "distributed.env")
    if p:
        raise UserError(p, title="invalid launch options")


def build_launch(opts: LaunchOptions) -> LaunchCommand:
    """The command (and environment) that starts this node's ranks.

    Raises:
        UserError: invalid options (all problems at once), unknown env preset.
    """
    validate(opts)
    env = merged_env(opts.config_env, opts.env_presets)
    _, secrets = split_secrets(env, opts.secret_env)
    port = opts.master_port
    role = "master" if opts.node_rank == 0 else "worker"
    procs = opts.procs_per_node
    if procs is None and opts.gpus_per_node is None and isinstance(opts.config_num_processes, int):
        procs = opts.config_num_processes
    nproc = nproc_per_node(opts.gpus_per_node, procs)
    per_node = f"{nproc} rank{'' if nproc == '1' else 's'} per node" if nproc != "gpu" else "one rank per visible GPU"
    files: dict[str, str] = {}

    if opts.launcher == "torchrun":
        program = list(opts.program) if opts.program else train_argv(opts.config, opts.overrides, opts.secret_env)
        standalone = opts.nodes == 1 and port is None
        if not standalone:
            port = port or DEFAULT_MASTER_PORT
        argv = torchrun_argv(
            opts.python,
            nproc,
            program,
            nnodes=opts.nodes,
            rdzv_endpoint=None if standalone else endpoint(opts.master_addr or "127.0.0.1", port),
            rdzv_id=opts.rdzv_id or f"scaletune-{port}",
            node_rank=None if standalone else opts.node_rank,
            # Node 0 hosts the rendezvous store; without this torchrun guesses from the host
            # name, which is ambiguous when several "nodes" share one machine.
            is_host=(opts.node_rank == 0) if opts.nodes > 1 else None,
            max_restarts=opts.max_restarts,
        )
    else:
        argv = [opts.python, "-m", DEEPSPEED_MODULE]
        port = port or DEFAULT_MASTER_PORT
        if opts.nodes > 1:
            hostfile = opts.hostfile or "scaletune-hostfile"
            slots = nproc if nproc != "gpu" else None
            if slots is None:
                raise UserError(
                    "--launcher deepspeed with several nodes needs --gpus-per-node (or --procs-per-node): "
                    "the hostfile lists the slots of every node",
                    title="invalid launch options",
                )
            # With --no_ssh each node runs its own launcher; the names only label the slots.
            files[hostfile] = "".join(f"node-{i} slots={slots}\n" for i in range(opts.nodes))
            argv += [
                "--hostfile",
                hostfile,
                "--no_ssh",
                "--node_rank",
                str(opts.node_rank),
                "--num_nodes",
                str(opts.nodes),
                "--master_addr",
                str(opts.master_addr),
            ]
        if nproc != "gpu":
            argv += ["--num_gpus", nproc]
        argv += ["--master_port", str(port), "--no_local_rank"]
        program = list(opts.program) if opts.program else train_argv(opts.config, opts.overrides, opts.secret_env)
        if program[0] == "-m":  # the runner's own spelling of `python -m MODULE`
            program = ["--module", *program[1:]]
        argv += program

    nodes = f"{opts.nodes} node{'s' if opts.nodes > 1 else ''}"
    where = f"node {opts.node_rank} ({role})" if opts.nodes > 1 else "single node"
    summary = f"{opts.launcher}: {nodes}, {per_node}; this is {where}"
    if opts.nodes > 1:
        summary += f"; rendezvous at {endpoint(str(opts.master_addr), port)}"
    return LaunchCommand(argv=argv, env=env, secret_names=secrets, files=files, role=role, summary=summary)
