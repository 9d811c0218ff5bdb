"""What a submitted config may do on this service (DESIGN.md, "The service's trust model"),
checked on the raw submitted mapping (the YAML with the overrides applied) before anything of it
is imported, resolved or read: no factory and no reward function but the built-ins (submitted
code), no `trust_remote_code`, only `distributed.env` variables of an allow-list of prefixes (none
that loads code: PYTHONPATH, LD_PRELOAD, PATH, ...), local data and models only under the read roots
(and in the service's data area, the files uploaded with `POST /api/data`), and the run directory
only in the job's own folder (or under an admin's write root), never another job's, never the
service's own files. Each is an admin setting (`scaletune serve --allow-... / --read-root /
--write-root`, or `PUT /api/admin/policy`); a refusal is a 422 naming the rule.

The request edge is here too: the config's nesting depth (aliases expanded) is measured on the
YAML event stream, which PyYAML parses without recursion, before the text is composed.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from scaletune import rewards
from scaletune.errors import Problem

# The variables a job may set in `distributed.env`, by name, each with why it is harmless: they
# tune communication, threads, the allocator, logging, offline modes and a W&B run's name; none
# chooses an endpoint, a cache, a token file, a plugin or a library (HF_ENDPOINT, HF_HUB_CACHE,
# HF_TOKEN_PATH, WANDB_BASE_URL, NCCL_NET_PLUGIN, CUDA_INJECTION64_PATH, TORCH_EXTENSIONS_DIR,
# TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD, PYTHONPATH, LD_PRELOAD, ... are refused), so no submitted setting
# can redirect the service's network, secrets or caches. Names, not prefixes: every prefix family
# holds one such variable, and new ones appear. An admin adds more with --allow-env.
JOB_ENV: dict[str, str] = {
    **dict.fromkeys(
        (
            "NCCL_DEBUG",
            "NCCL_DEBUG_SUBSYS",
            "NCCL_SOCKET_IFNAME",
            "NCCL_SOCKET_NTHREADS",
            "NCCL_NSOCKS_PERTHREAD",
            "NCCL_IB_DISABLE",
            "NCCL_IB_HCA",
            "NCCL_IB_GID_INDEX",
            "NCCL_IB_TIMEOUT",
            "NCCL_IB_RETRY_CNT",
            "NCCL_P2P_DISABLE",
            "NCCL_P2P_LEVEL",
            "NCCL_SHM_DISABLE",
            "NCCL_NET_GDR_LEVEL",
            "NCCL_CROSS_NIC",
            "NCCL_ALGO",
            "NCCL_PROTO",
            "NCCL_BUFFSIZE",
            "NCCL_NTHREADS",
            "NCCL_MIN_NCHANNELS",
            "NCCL_MAX_NCHANNELS",
            "GLOO_SOCKET_IFNAME",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "TORCH_NCCL_BLOCKING_WAIT",
            "TORCH_NCCL_DUMP_ON_TIMEOUT",
            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
            "TORCH_NCCL_ENABLE_MONITORING",
            "TORCH_NCCL_TRACE_BUFFER_SIZE",
            "TORCH_NCCL_AVOID_RECORD_STREAMS",
        ),
        "collective communication: interfaces, transports, timeouts, debugging",
    ),
    **dict.fromkeys(
        ("TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES", "CUDA_LAUNCH_BLOCKING"),
        "logging and error reports",
    ),
    **dict.fromkeys(
        ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "CUDA_DEVICE_MAX_CONNECTIONS"),
        "threads and streams",
    ),
    **dict.fromkeys(
        ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING", "CUDA_MODULE_LOADING"),
        "the CUDA allocator and module loading",
    ),
    **dict.fromkeys(
        (
            "HF_HUB_OFFLINE",
            "HF_DATASETS_OFFLINE",
            "TRANSFORMERS_OFFLINE",
            "HF_HUB_DISABLE_PROGRESS_BARS",
            "HF_HUB_DISABLE_TELEMETRY",
            "HF_HUB_ETAG_TIMEOUT",
            "HF_HUB_DOWNLOAD_TIMEOUT",
        ),
        "the Hugging Face hub's offline mode, timeouts and output (not where it connects or caches)",
    ),
    **dict.fromkeys(
        ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_NAME", "WANDB_MODE", "WANDB_TAGS", "WANDB_RUN_GROUP", "WANDB_NOTES"),
        "the W&B run's name and mode (not where it connects)",
    ),
    **dict.fromkeys(
        ("HF_TOKEN", "WANDB_API_KEY"),
        "the job's own credential, a secret: kept out of every record and sent to the default endpoint only",
    ),
}
# Refused even when an admin's --allow-env prefix covers it: turns remote code on
# (HF_DATASETS_TRUST_REMOTE_CODE) or turns the restricted unpickler off (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD).
_NEVER_ENV = ("TRUST_REMOTE_CODE", "NO_WEIGHTS_ONLY")
MAX_DEPTH = 64  # nesting of a config, aliases expanded (a real one has about 5)
MAX_REQUEST_BYTES = 4 * 1024 * 1024
MAX_UPLOAD_BYTES = 256 * 1024 * 1024  # one data file uploaded to the data area (POST /api/data)
MAX_DATA_BYTES = 8 * 1024**3  # every uploaded file together: a submit token cannot fill the disk
DATA_AREA = "data"  # the uploaded data files' folder, in the jobs folder (a job id is 12 hex digits)
# The reward functions that are not submitted code: `scaletune.rewards:NAME`, NAME one the package exports.
BUILTIN_REWARDS = tuple(f"scaletune.rewards:{name}" for name in rewards.__all__)


@dataclass(frozen=True)
class Policy:
    """The admin settings.

    disabled_targets: targets jobs may not be sent to (`--disable-target`: `local` on a web-only
        deployment that sends every run to Modal or SLURM).
    env_prefixes: `distributed.env` names (a name, or a prefix of names) jobs may set besides
        `JOB_ENV` (`--allow-env`); never one that turns remote code on or the restricted unpickler off.
    read_roots: folders local data, models and checkpoints may be read from; None: the service's
        working directory (relative paths are read from it).
    write_roots: folders a run directory may be in besides the job's own folder.
    trusted_hosts: Host names answered besides loopback's (checked in the token-less mode, and
        always once any is given).
    trusted_origins: origins (scheme://host:port) allowed to make unsafe requests besides the
        service's own.
    max_upload_bytes: the largest data file `POST /api/data` takes into the data area (the other
        routes keep max_request_bytes).
    max_data_bytes: the data area's quota: the bytes of every uploaded file together (an upload
        that would pass it is refused, 413).
    job_secrets: `OWNER:NAME=VAR` (`--job-secret`): the jobs the API token named OWNER submits
        (`*`: every job) get the service's variable VAR as NAME. A job inherits none of the
        service's other credentials (any variable the secret rule of `config/secrets.py` names).
    keep_checkpoints_days: the `checkpoints/step-*` folders of a job that ended succeeded, failed
        or cancelled are deleted by the service's sweep once it has been ended this many days (and
        nothing wrote to the folder for as long); `final/`, exports and a stopped job's checkpoints
        (it is meant to resume) stay. 0: kept for ever (`jobs/retention.py`).
    """

    allow_factories: bool = False
    allow_remote_code: bool = False
    env_prefixes: tuple[str, ...] = ()
    disabled_targets: tuple[str, ...] = ()
    read_roots: tuple[str, ...] | None = None
    write_roots: tuple[str, ...] = ()
    trusted_hosts: tuple[str, ...] = ()
    trusted_origins: tuple[str, ...] = ()
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_upload_bytes: int = MAX_UPLOAD_BYTES
    max_depth: int = MAX_DEPTH
    max_data_bytes: int = MAX_DATA_BYTES
    job_secrets: tuple[str, ...] = ()
    keep_checkpoints_days: int = 0

    def public(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}

    def updated(self, **changes: Any) -> Policy:
        return replace(self, **{k: tuple(v) if isinstance(v, list) else v for k, v in changes.items()})


@dataclass
class Places:
    """Where the service keeps things, for the path rules: the jobs folder, this job's folder, the
    database file (None when not SQLite), the other jobs' run directories, the working directory."""

    jobs_home: Path
    job_dir: Path
    db_file: Path | None
    other_runs: list[Path] = field(default_factory=list)
    workdir: Path = field(default_factory=Path.cwd)

    @property
    def data_area(self) -> Path:
        return data_area(self.jobs_home)


_JOB_SECRET = re.compile(
    r"(?P<owner>\*|[A-Za-z0-9_.@-]{1,64}):(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<var>[A-Za-z_][A-Za-z0-9_]*)"
)


def job_secret_problems(specs: Iterable[str], environ: Mapping[str, str]) -> list[Problem]:
    """Every problem of `--job-secret` values: the form, a service secret handed on (the admin
    token, the database URL, Modal's credentials: `SERVICE_SECRETS`), a variable the service does
    not have, a name that turns remote code on or the restricted unpickler off."""
    from scaletune.serve.jobs.dispatch.base import SERVICE_SECRETS

    problems: list[str] = []
    for spec in specs:
        m = _JOB_SECRET.fullmatch(spec)
        if m is None:
            problems.append(f"--job-secret {spec!r}: expected OWNER:NAME=VAR (OWNER a token's name or *)")
            continue
        own = next((v for v in (m["var"], m["name"]) if v in SERVICE_SECRETS), None)
        if own is not None:
            problems.append(f"--job-secret {spec!r}: {own} is the service's own secret, never a job's")
        elif m["var"] not in environ:
            problems.append(f"--job-secret {spec!r}: the service's environment has no {m['var']}")
        if any(w in m["name"] for w in _NEVER_ENV):
            problems.append(f"--job-secret {spec!r}: {m['name']} is never set for a job")
    return [Problem("serve options", None, m) for m in problems]


def job_secrets_for(policy: Policy, owner: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The service's variables mapped to a job of `owner` (`--job-secret`), by their job names;
    a mapping for that owner wins over one for `*`."""
    out: dict[str, str] = {}
    for exact in (False, True):
        for spec in policy.job_secrets:
            m = _JOB_SECRET.fullmatch(spec)
            if m is None or (m["owner"] != owner if exact else m["owner"] != "*"):
                continue
            if m["var"] in environ:
                out[m["name"]] = environ[m["var"]]
    return out


def data_area(jobs_home: Path) -> Path:
    """The folder of the data files uploaded through the API (`POST /api/data`): readable by every
    job's config, besides the read roots; written only by the service's upload route."""
    return jobs_home / DATA_AREA


# -- the rules on the raw mapping ---------------------------------------------------------------
def walk(node: Any, path: tuple = (), depth: int = 0) -> Iterator[tuple[tuple, Any]]:
    yield path, node
    if depth > MAX_DEPTH:
        return
    if isinstance(node, dict):
        for k, v in node.items():
            yield from walk(v, (*path, str(k)), depth + 1)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk(v, (*path, str(i)), depth + 1)


def user_reward_function(path: tuple, value: Any) -> bool:
    """Whether `value`, at `path` in a submitted mapping, is a reward function that is user code: any
    `...rl.rewards.N.function` (`training.rl`, a stage's too) but the exact text of a built-in."""
    in_rewards = len(path) >= 4 and path[-4:-2] == ("rl", "rewards") and path[-1] == "function"
    return in_rewards and value is not None and value not in BUILTIN_REWARDS


def _get(data: Any, *keys: str) -> Any:
    for k in keys:
        data = data.get(k) if isinstance(data, dict) else None
    return data


def inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


def _real(p: Path) -> Path:
    return Path(os.path.realpath(p))


def _local_path(value: Any, workdir: Path) -> Path | None:
    """The resolved local path a config value names; None for a hub id (not a local file)."""
    if not isinstance(value, str) or not value:
        return None
    p = Path(os.path.expanduser(value))
    if not (value.startswith(("/", ".", "~")) or (workdir / p).exists()):
        return None  # owner/name on the hub
    return _real(p if p.is_absolute() else workdir / p)


def _read_paths(data: dict) -> Iterator[tuple[str, Any]]:
    """(key, value) of every key whose value is read as a local path."""
    yield "model.name_or_path", _get(data, "model", "name_or_path")
    yield "model.tokenizer", _get(data, "model", "tokenizer")
    yield "distributed.deepspeed_config", _get(data, "distributed", "deepspeed_config")
    resume = _get(data, "training", "resume")
    if resume != "auto":
        yield "training.resume", resume
    stages = data.get("stages") if isinstance(data.get("stages"), list) else []
    # Read by objectives: a distillation teacher's folder, a replayed rollouts.jsonl (a stage's too).
    for prefix, training in [
        ("training", data.get("training")),
        *((f"stages.{i}.training", _get(s, "training")) for i, s in enumerate(stages)),
    ]:
        yield f"{prefix}.distill.teacher", _get(training, "distill", "teacher")
        yield f"{prefix}.rl.replay", _get(training, "rl", "replay")
        yield f"{prefix}.distill.replay", _get(training, "distill", "replay")
    for prefix, section in [
        ("data", data.get("data")),
        *((f"stages.{i}.data", _get(s, "data")) for i, s in enumerate(stages)),
    ]:
        for split in ("train", "eval"):
            value = _get(section, split, "path")
            for j, v in enumerate(value if isinstance(value, list) else [value]):
                yield f"{prefix}.{split}.path" + (f".{j}" if isinstance(value, list) else ""), v


def check(data: dict, policy: Policy, places: Places) -> tuple[list[str], Path | None]:
    """The policy's problems of a submitted mapping, and the run directory it gets (None when
    refused). A relative `output_dir` is placed in the job's folder.

    Every problem starts with `policy:` and ends with the admin setting that allows it, if any.
    """
    problems: list[str] = []
    for path, value in walk(data):
        key = ".".join(path)
        if path and path[-1] == "factory" and value is not None and not policy.allow_factories:
            problems.append(
                f"policy: {key}: this service imports no submitted code (a factory); "
                "admin setting: scaletune serve --allow-factories"
            )
        if user_reward_function(path, value) and not policy.allow_factories:
            problems.append(
                f"policy: {key}: this service imports no submitted code (a reward function other than the "
                f"built-ins {', '.join(BUILTIN_REWARDS)}); admin setting: scaletune serve --allow-factories"
            )
        if path and path[-1] == "trust_remote_code" and value not in (None, False) and not policy.allow_remote_code:
            problems.append(
                f"policy: {key}: this service runs no model-folder code; admin setting: --allow-remote-code"
            )
    if _get(data, "logging", "mlflow", "tracking_uri") is not None:
        # An endpoint or a store path of the job's choosing, as WANDB_BASE_URL would be: the service's
        # jobs log where its own MLFLOW_TRACKING_URI says (none: MLflow's default, in the job's folder).
        problems.append(
            "policy: logging.mlflow.tracking_uri: chooses where the job sends or writes its metrics; jobs here "
            "log to the service's MLFLOW_TRACKING_URI (set it on the service); no setting allows it"
        )
    env = _get(data, "distributed", "env")
    for name in env if isinstance(env, dict) else {}:
        name = str(name)
        if any(w in name.upper() for w in _NEVER_ENV):
            problems.append(
                f"policy: distributed.env.{name}: turns remote code on or the restricted unpickler off; "
                "no setting allows it"
            )
        elif name not in JOB_ENV and not name.startswith(tuple(policy.env_prefixes)):
            problems.append(
                f"policy: distributed.env.{name}: not among the variables a job may set here (those that "
                "choose an endpoint, a cache, a token file, a plugin or a library are refused; the list is "
                f"in docs/security.md); admin setting: --allow-env {name}"
            )
    own = [_real(places.job_dir)]
    run_dir, out_problem = _run_dir(data, policy, places)
    if out_problem:
        problems.append(out_problem)
    else:
        own.append(run_dir)  # type: ignore[arg-type]
    roots = [_real(Path(r)) for r in (policy.read_roots if policy.read_roots is not None else [places.workdir])]
    area = _real(places.data_area)
    for key, value in _read_paths(data):
        if isinstance(value, str) and "\x00" in value:
            problems.append(f"policy: {key}: contains a NUL byte")
            continue
        p = _local_path(value, places.workdir)
        if p is None or any(inside(p, o) for o in own) or inside(p, area):
            continue  # the job's own files, or the data area's (in the jobs folder, yet no job's)
        why = _service_file(p, places) or (
            None if any(inside(p, r) for r in roots) else "is outside the folders this service reads from"
        )
        if why:
            problems.append(f"policy: {key}: {value}: {why}; admin setting: --read-root FOLDER")
    return problems, (None if out_problem else run_dir)


def _service_file(p: Path, places: Places) -> str | None:
    """Why `p` belongs to the service or another job (None when it does not)."""
    home = _real(places.jobs_home)
    if inside(p, home) and not inside(p, _real(places.job_dir)):
        return "is in the folder of another job"
    if places.db_file is not None:
        db = _real(places.db_file)
        if p.parent == db.parent and p.name.startswith(db.name) or inside(db, p):
            return "is the service's database"
    return None


def _run_dir(data: dict, policy: Policy, places: Places) -> tuple[Path | None, str | None]:
    value = data.get("output_dir", "runs/default")
    if not isinstance(value, str) or not value or "\x00" in value:
        return None, f"policy: output_dir: {value!r} is not a folder name"
    expanded = os.path.expanduser(value)
    if not os.path.isabs(expanded):
        rel = posixpath.normpath(expanded.replace(os.sep, "/"))
        if rel == ".." or rel.startswith("../"):
            return None, f"policy: output_dir: {value}: leaves the job's folder"
        return _real(places.job_dir) / rel, None
    p = _real(Path(expanded))
    why = _service_file(p, places)
    if why is None and not (
        inside(p, _real(places.job_dir)) or any(inside(p, _real(Path(r))) for r in policy.write_roots)
    ):
        why = "writes outside the jobs folder (give a relative path); admin setting: --write-root FOLDER"
    if why is None and inside(_real(places.jobs_home), p):
        why = "holds the jobs folder"
    for other in places.other_runs:
        o = _real(other)
        if why is None and (inside(p, o) or inside(o, p)):
            why = "is (or holds) another job's run directory"
    if why:
        return None, f"policy: output_dir: {value}: {why}"
    return p, None
