"""Modal apps that run one config on Modal GPUs: options in, Python source out.

The written app (Modal SDK) builds an image with scaletune and its dependencies, adds the
local files the config names (model folder, data files) to it, mounts a `modal.Volume` for the
run directory, and runs `scaletune train` with the config embedded in the app: directly on one
GPU, under torchrun with one rank per GPU on several. Secrets come from Modal secrets
(`modal.Secret.from_name`), never from the file.

Run it with `modal run APP.py` (or `modal deploy`); the run directory lands in the volume.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import jinja2
import yaml

from scaletune.config import secret_names
from scaletune.errors import UserError
from scaletune.launch.commands import single_node_torchrun_argv
from scaletune.launch.presets import merged_env, split_secrets

# GPU types Modal documents (https://modal.com/docs/guide/gpu); others are refused so a typo
# does not surface only at deploy time. Compared case-insensitively.
MODAL_GPU_TYPES = (
    "T4",
    "L4",
    "A10",
    "A10G",
    "A100",
    "A100-40GB",
    "A100-80GB",
    "L40S",
    "H100",
    "H100!",
    "H200",
    "B200",
    "B200+",
)
MAX_GPUS_PER_CONTAINER = 8
REMOTE_ROOT = "/root/scaletune-run"
REMOTE_INPUTS = "/root/scaletune-inputs"
RUNS_MOUNT = "/runs"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class ModalOptions:
    gpu_count: int
    gpu_type: str
    app_name: str = "scaletune"
    volume: str = "scaletune-runs"
    secrets: tuple[str, ...] = ()
    timeout_hours: float = 24.0
    python_version: str = f"{sys.version_info.major}.{sys.version_info.minor}"
    requirements: tuple[str, ...] = ()
    env_presets: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModalPlan:
    """What the app carries: the config to embed and the local paths to add to the image."""

    config: dict[str, Any]
    mounts: dict[str, str] = field(default_factory=dict)  # local absolute path -> remote path
    secret_env_names: list[str] = field(default_factory=list)


def validate(opts: ModalOptions) -> None:
    p = []
    if not 1 <= opts.gpu_count <= MAX_GPUS_PER_CONTAINER:
        p.append(f"--gpu-count must be 1..{MAX_GPUS_PER_CONTAINER} (Modal's GPUs per container), got {opts.gpu_count}")
    if opts.gpu_type.upper() not in {t.upper() for t in MODAL_GPU_TYPES}:
        p.append(f"--gpu-type {opts.gpu_type!r} is not a Modal GPU type; one of {', '.join(MODAL_GPU_TYPES)}")
    for what, v in (("--app-name", opts.app_name), ("--volume", opts.volume), *(("--secret", s) for s in opts.secrets)):
        if not _NAME.match(v):
            p.append(f"{what} {v!r}: use letters, digits, '.', '_' and '-' (at most 64)")
    if not 0 < opts.timeout_hours <= 24:
        p.append(f"--timeout-hours must be in (0, 24] (Modal's limit), got {opts.timeout_hours}")
    if p:
        raise UserError(p, title="invalid modal options")


def plan_inputs(config: dict[str, Any], cwd: Path) -> ModalPlan:
    """Find the local files the config names, give each a path in the image, and rewrite the
    config to use those paths; `output_dir` moves into the volume. Hub ids (no local file of
    that name) stay as they are. Secret-looking `distributed.env` entries are dropped (a Modal
    secret provides them)."""
    cfg = yaml.safe_load(yaml.safe_dump(config))  # deep copy of plain data
    mounts: dict[str, str] = {}

    def mounted(value: str) -> str:
        p = Path(value).expanduser()
        p = p if p.is_absolute() else cwd / p
        if not p.exists():
            return value
        local = str(p.resolve())
        if local not in mounts:
            mounts[local] = str(PurePosixPath(REMOTE_INPUTS) / f"{len(mounts)}-{p.name}")
        return mounts[local]

    def localize(holder: dict | None, key: str) -> None:
        if not isinstance(holder, dict):
            return
        value = holder.get(key)
        if isinstance(value, str):
            holder[key] = mounted(value)
        elif isinstance(value, list):  # data.train.path: a list of files
            holder[key] = [mounted(v) if isinstance(v, str) else v for v in value]

    localize(cfg.get("model"), "name_or_path")
    localize(cfg.get("model"), "tokenizer")
    localize(cfg.get("distributed"), "deepspeed_config")
    datas = [cfg.get("data")] + [s.get("data") for s in cfg.get("stages") or [] if isinstance(s, dict)]
    for d in datas:
        if isinstance(d, dict):
            localize(d.get("train"), "path")
            localize(d.get("eval"), "path")
    cfg["output_dir"] = str(PurePosixPath(RUNS_MOUNT) / volume_run_name(str(cfg.get("output_dir") or "runs/default")))
    dist = cfg.get("distributed") or {}
    env = dist.get("env") or {}
    secrets = secret_names(env, dist.get("secret_env") or ())
    for k in secrets:
        del env[k]
    return ModalPlan(config=cfg, mounts=mounts, secret_env_names=secrets)


def volume_run_name(output_dir: str) -> str:
    """The run directory's path inside the volume: the last name of `output_dir` only, so `..` or
    a path cannot step out of it."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", PurePosixPath(output_dir).name).strip(".-") or "run"


_TEMPLATE = '''\
"""Modal app written by `scaletune modal`.

Runs `scaletune train` on GPU_COUNT x GPU_TYPE (one process, or torchrun with one rank per GPU).
The config is embedded below as CONFIG_YAML (paths rewritten to the files added to the image);
the run directory, OUTPUT_DIR, is in the Modal volume VOLUME.

    modal run THIS_FILE                                   # run once (the volume keeps the results)
    modal volume get VOLUME OUTPUT_DIR_IN_VOLUME .        # fetch the run directory

Secrets are never written here: the variables in SECRET_ENV_NAMES come from the Modal secrets
attached to the function (`modal secret create NAME VAR=...`, then `scaletune modal --secret NAME`).
Every value from the config or the command line below is a Python literal.
"""

import modal

APP_NAME = {{ app_name | py }}
VOLUME = {{ volume | py }}
OUTPUT_DIR = {{ output_dir | py }}
OUTPUT_DIR_IN_VOLUME = {{ output_dir_rel | py }}
SECRET_ENV_NAMES = {{ secret_env_names | py }}
GPU_TYPE = {{ gpu_type | py }}
GPU_COUNT = {{ gpu_count | py }}
GPU = f"{GPU_TYPE}:{GPU_COUNT}"
RUNS = {{ runs | py }}
WORKDIR = {{ workdir | py }}
CONFIG_PATH = {{ config_path | py }}
# The resolved config (scaletune's config.yaml format), paths pointing into the image.
CONFIG_YAML = {{ config_yaml | py }}
# Each rank runs `python -m scaletune train CONFIG`; with several GPUs torchrun starts one per GPU.
COMMAND = {{ command | py }}

image = (
    modal.Image.debian_slim(python_version={{ python_version | py }})
    .pip_install({% for r in requirements %}{{ r | py }}{% if not loop.last %}, {% endif %}{% endfor %})
{%- if env %}
    .env({{ env | py }})
{%- endif %}
{%- for local, remote in mounts %}
    .{{ "add_local_dir" if local_is_dir[local] else "add_local_file" }}({{ local | py }}, {{ remote | py }})
{%- endfor %}
    # scaletune itself, with its bundled assets (Modal adds only .py files by default).
    .add_local_python_source("scaletune", ignore=["**/__pycache__", "**/*.pyc"])
)
volume = modal.Volume.from_name({{ volume | py }}, create_if_missing=True)
app = modal.App(APP_NAME)


@app.function(
    image=image,
    gpu=GPU,
    volumes={RUNS: volume},
    secrets=[{% for s in secrets %}modal.Secret.from_name({{ s | py }}){% if not loop.last %}, {% endif %}{% endfor %}],
    timeout={{ timeout_s | py }},
)
def train() -> dict:
    import os
    import subprocess

    os.makedirs(WORKDIR, exist_ok=True)
    with open(CONFIG_PATH, "w") as f:
        f.write(CONFIG_YAML)
    # add_local_python_source puts scaletune in /root; the ranks are new interpreters.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, ["/root", os.environ.get("PYTHONPATH")])))
    try:
        code = subprocess.run(COMMAND, cwd=WORKDIR, env=env).returncode
    finally:
        volume.commit()  # keep checkpoints and logs even when the run fails
    # How the run ended, as the call's result: what a `scaletune serve` job is settled by (the
    # service cannot see the volume's run directory).
    return {"exit_code": code, "final": os.path.isdir(os.path.join(OUTPUT_DIR, "final"))}


@app.local_entrypoint()
def main() -> None:
    result = train.remote()
    if result["exit_code"]:
        raise SystemExit(f"scaletune train exited {result['exit_code']} (the volume keeps its logs)")
'''


def render_modal_app(opts: ModalOptions, plan: ModalPlan, local_dirs: frozenset[str] = frozenset()) -> str:
    """The Modal app's source.

    Args:
        local_dirs: which of `plan.mounts` are directories (added with `add_local_dir`).

    Raises:
        UserError: invalid options, unknown env preset.
    """
    validate(opts)
    env = merged_env((plan.config.get("distributed") or {}).get("env"), opts.env_presets)
    public, _ = split_secrets(env, plan.secret_env_names)
    config_path = f"{REMOTE_ROOT}/config.yaml"
    if opts.gpu_count > 1:
        command = single_node_torchrun_argv("python", opts.gpu_count, [config_path])
    else:
        command = ["python", "-m", "scaletune", "train", config_path]
    gpu_type = next(t for t in MODAL_GPU_TYPES if t.upper() == opts.gpu_type.upper())
    env_ = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    env_.filters["py"] = repr
    output_dir = plan.config["output_dir"]
    return env_.from_string(_TEMPLATE).render(
        gpu_count=opts.gpu_count,
        gpu_type=gpu_type,
        output_dir=output_dir,
        output_dir_rel=output_dir[len(RUNS_MOUNT) + 1 :],
        volume=opts.volume,
        secret_env_names=plan.secret_env_names,
        app_name=opts.app_name,
        runs=RUNS_MOUNT,
        workdir=REMOTE_ROOT,
        config_path=config_path,
        config_yaml=yaml.safe_dump(plan.config, sort_keys=False),
        command=command,
        python_version=opts.python_version,
        requirements=list(opts.requirements),
        env=public,
        mounts=sorted(plan.mounts.items()),
        local_is_dir={k: k in local_dirs for k in plan.mounts},
        secrets=list(opts.secrets),
        timeout_s=int(opts.timeout_hours * 3600),
    )


def image_requirements(strategy: str) -> tuple[str, ...]:
    """What the app's image installs for a run of distributed `strategy`: scaletune's own
    dependencies, and deepspeed's where the strategy may pick it (`auto` decides on Modal's GPUs).
    The one list both `scaletune modal` and a `scaletune serve` Modal job use.

    Raises:
        RuntimeError: scaletune's package metadata is missing (a source tree run without
            installing it): the image would install none of its dependencies.
    """
    reqs = scaletune_requirements(deepspeed=strategy in ("auto", "deepspeed"))
    if not reqs:
        raise RuntimeError(
            "scaletune's package metadata is missing, so the Modal image would install none of its "
            "dependencies: install scaletune (pip install -e .) in the environment that writes the app"
        )
    return tuple(reqs)


def scaletune_requirements(deepspeed: bool = False) -> list[str]:
    """scaletune's own dependencies (from its installed metadata), for the image."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        reqs = requires("scaletune") or []
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        reqs = []
    out = []
    for r in reqs:
        spec, _, marker = r.partition(";")
        if "extra" in marker:
            if deepspeed and 'extra == "deepspeed"' in marker:
                out.append(spec.strip())
            continue
        out.append(spec.strip())
    return out
