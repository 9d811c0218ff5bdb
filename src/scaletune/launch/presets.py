"""Named environment presets for NCCL / torch.distributed, instead of hand-edited `export` lines.

Each preset names the symptom it addresses (docs/launch.md has the same table). Presets are
given on the command line (`--env-preset debug --env-preset no-ib`); `socket-ifname=IFACE` takes
a value. The environment a launch sets is, in order (later wins): `distributed.env` from the
YAML, then the presets in the order given.

Secret variables (:mod:`scaletune.config.secrets`: names that look like credentials, or listed in
`distributed.secret_env`) are never written into generated scripts: :func:`split_secrets`
separates them so the script passes them through from the environment of whoever runs it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from scaletune.config import secret_names
from scaletune.errors import Problem, UserError


@dataclass(frozen=True)
class Preset:
    name: str
    env: Mapping[str, str]
    symptom: str
    takes_value: bool = False  # `name=VALUE`; `{value}` in env values is replaced


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "debug",
            {
                "NCCL_DEBUG": "INFO",
                "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV",
                "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                "TORCH_CPP_LOG_LEVEL": "INFO",
                "TORCH_SHOW_CPP_STACKTRACES": "1",
                "PYTHONFAULTHANDLER": "1",
            },
            "a job hangs at start-up or in a collective, or dies with 'NCCL error' and no detail: "
            "logs which transport and interface NCCL picked, checks that every rank calls the same "
            "collectives with the same shapes, and turns a hang into an error with stack traces",
        ),
        Preset(
            "no-p2p",
            {"NCCL_P2P_DISABLE": "1"},
            "hangs or garbage results between GPUs of one node (consumer boards, VMs or PCIe "
            "switches with ACS/IOMMU that break peer-to-peer): traffic goes through host memory",
        ),
        Preset(
            "no-ib",
            {"NCCL_IB_DISABLE": "1"},
            "'NET/IB : No device found', 'ibv_*' errors or a hang at the first collective across "
            "nodes whose InfiniBand/RoCE adapters are present but not cabled or configured: uses "
            "TCP sockets instead",
        ),
        Preset(
            "no-shm",
            {"NCCL_SHM_DISABLE": "1"},
            "'Bus error' or 'unhandled system error' in containers with a small /dev/shm (Docker's "
            "64 MB default); better: run the container with --shm-size or --ipc=host",
        ),
        Preset(
            "socket-ifname",
            # GLOO_SOCKET_IFNAME is added by preset_env where the value names interfaces (gloo has no
            # '^' exclusion; for one, each node derives gloo's from NCCL's when the process group starts).
            {"NCCL_SOCKET_IFNAME": "{value}"},
            "nodes that reach each other only over one interface (docker0, lo or a management "
            "network picked instead): 'socket-ifname=eth0' pins NCCL and gloo to that interface "
            "(a '^' prefix excludes: '^docker,lo'; gloo then uses the first interface left, found on each node)",
            takes_value=True,
        ),
        Preset(
            "long-timeouts",
            {
                "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "1800",
                "NCCL_IB_TIMEOUT": "22",
                "NCCL_IB_RETRY_CNT": "13",
            },
            "'Watchdog caught collective operation timeout' or 'heartbeat monitor' kills while one "
            "rank is slow on purpose (large checkpoint save, long data preprocessing on rank 0), "
            "or IB retry errors on a congested fabric; raise distributed.timeout_minutes too",
        ),
    )
}

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_IFNAME = re.compile(r"^\^?[A-Za-z0-9_.:=,-]+$")


def env_name_problems(env: Mapping[str, str], where: str) -> list[Problem]:
    """Variable names/values in `env` (the config key `where`) that could not be exported safely."""
    out = []
    for k, v in env.items():
        if not _NAME.match(k):
            out.append(Problem("environment", where, f"{where}: {k!r} is not a valid environment variable name"))
        if "\x00" in str(v):
            out.append(Problem("environment", where, f"{where}: the value of {k} contains a NUL character"))
    return out


def preset_problems(names: Iterable[str]) -> list[Problem]:
    """The problems :func:`preset_env` would raise, as a list (for all-at-once reporting)."""
    return _presets(names)[1]


def preset_env(names: Iterable[str]) -> dict[str, str]:
    """The variables of the presets, later presets winning.

    Raises:
        UserError: an unknown preset, a missing or unexpected value.
    """
    env, problems = _presets(names)
    if problems:
        raise UserError(problems, title="invalid --env-preset")
    return env


def _presets(names: Iterable[str]) -> tuple[dict[str, str], list[Problem]]:
    """The variables of the presets that are valid, and a problem for each that is not."""
    env: dict[str, str] = {}
    problems = []
    for raw in names:
        name, sep, value = raw.partition("=")
        preset = PRESETS.get(name)
        if preset is None:
            problems.append(_preset(f"unknown env preset {raw!r}; known: {', '.join(describe_names())}"))
            continue
        if preset.takes_value and not value:
            problems.append(_preset(f"env preset {name} needs a value: {name}=VALUE"))
            continue
        if not preset.takes_value and sep:
            problems.append(_preset(f"env preset {name} takes no value (got {raw!r})"))
            continue
        if preset.takes_value and not _IFNAME.match(value):
            problems.append(_preset(f"env preset {name}: {value!r} is not an interface name or list"))
            continue
        env.update({k: v.replace("{value}", value) for k, v in preset.env.items()})
        if name == "socket-ifname":
            env.pop("GLOO_SOCKET_IFNAME", None)
            if not value.startswith("^"):
                # gloo takes the names themselves (NCCL's '=' means exact names, which gloo's are anyway).
                env["GLOO_SOCKET_IFNAME"] = value.removeprefix("=")
    return env, problems


def _preset(message: str) -> Problem:
    return Problem("env preset", None, message)


def describe_names() -> list[str]:
    return [f"{p.name}=VALUE" if p.takes_value else p.name for p in PRESETS.values()]


def merged_env(config_env: Mapping[str, str] | None, presets: Iterable[str] = ()) -> dict[str, str]:
    """`distributed.env` from the YAML, then the presets on top.

    Raises:
        UserError: unknown preset, or a name that is not a valid variable name.
    """
    config_env = dict(config_env or {})
    problems = env_name_problems(config_env, "distributed.env")
    if problems:
        raise UserError(problems, title="invalid distributed.env")
    env = {k: str(v) for k, v in config_env.items()}
    env.update(preset_env(presets))
    return env


def split_secrets(env: Mapping[str, str], extra: Iterable[str] = ()) -> tuple[dict[str, str], list[str]]:
    """(variables safe to write down, sorted names of the secret variables); `extra`: the config's
    `distributed.secret_env`."""
    names = secret_names(env, extra)
    return {k: v for k, v in env.items() if k not in names}, names
