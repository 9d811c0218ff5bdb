"""What the tests share: the paths of the real data, the three builders (:func:`make_config`,
:func:`make_env`, :func:`run_torchrun`), running the real CLI in a subprocess and reading what a run
wrote. Constants live here, not in conftest.py (which pytest imports on its own terms)."""

from __future__ import annotations

import atexit
import base64
import functools
import hashlib
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

if TYPE_CHECKING:
    from scaletune.config import Config
    from scaletune.env import DistributedEnv

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO_ROOT.parent / "shared" / "data").resolve()
ALPACA_5000 = SHARED_DATA / "alpaca_5000.json"
NEOX_TOKENIZER = SHARED_DATA / "tokenizers" / "gpt-neox-20b.json"
OLMO2_TOKENIZER = SHARED_DATA / "tokenizers" / "olmo2-dolma2.json"
BUNDLED_ALPACA = REPO_ROOT / "examples" / "data" / "alpaca_400.json"
# OLMo-2's tokenizer cut down to the 27,110 tokens the project's data uses (scripts/make_test_tokenizer.py;
# tests/assets/README.md): it cuts that data exactly as OLMo-2's does, and tiny models built with it are
# 3.7M parameters instead of 13.2M.
SMALL_TOKENIZER = REPO_ROOT / "tests" / "assets" / "olmo2-alpaca.json"

# The LoRA model section of the distributed parity and resume runs.
LORA = {"lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "auto"}, "gradient_checkpointing": True}

# The variables a launcher sets for its workers: a subprocess that starts its own ranks must not
# inherit a parent job's.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def make_config(
    model: Path | str, out: Path | str, /, *layers: dict[str, Any], as_config: bool = False, **sections: Any
) -> dict | Config:
    """The config of a tiny run, as the dict a YAML file would hold (or, `as_config=True`, the
    validated :class:`scaletune.config.Config`; schema problems raise ConfigError).

    The base: `model` (a folder, preset or any name) in float32 with sdpa attention, 64 real Alpaca
    records at seq 64, 8 sequences per step in micro batches of 2, 8 steps at lr 2e-3 (cosine,
    2 warmup steps, clip 1.0) saving a checkpoint at step 4 and at the end, one process
    (`strategy: single`), no TensorBoard. Each keyword names a top-level key: a mapping updates
    that section (a value of None removes the key, e.g. `data={"train": None, "dummy": {}}`),
    anything else replaces it (`seed=7`). `layers` are such keywords as mappings (a test file's own
    base), applied in order before `sections`."""
    cfg: dict[str, Any] = {
        "output_dir": str(out),
        "seed": 1234,
        "model": {
            "name_or_path": str(model),
            "dtype": "float32",
            "attn_implementation": "sdpa",
            "gradient_checkpointing": False,
        },
        "data": {
            "train": {"path": str(ALPACA_5000), "format": "alpaca", "max_samples": 64},
            "max_seq_length": 64,
        },
        "training": {
            "global_batch_size": 8,
            "micro_batch_size": 2,
            "max_steps": 8,
            "learning_rate": 2.0e-3,
            "lr_scheduler": "cosine",
            "warmup_steps": 2,
            "max_grad_norm": 1.0,
            "eval_every": 0,
            "save_every": 4,
            "log_every": 1,
        },
        "distributed": {"strategy": "single", "num_processes": 1},
        "logging": {"tensorboard": False},
    }
    for layer in (*layers, sections):
        for name, values in layer.items():
            if not isinstance(values, dict):
                cfg[name] = values
                continue
            section = cfg.setdefault(name, {})
            for key, value in values.items():
                if value is None:
                    section.pop(key, None)
                else:
                    section[key] = value
    if not as_config:
        return cfg
    from scaletune.config import load_config

    return load_config(None, data=cfg)


def make_env(
    world: int = 1,
    *,
    rank: int = 0,
    launcher: str | None = None,
    gpus: int = 0,
    memory_gib: float | None = None,
    bf16: bool | None = None,
    local_world: int | None = None,
) -> DistributedEnv:
    """The :class:`scaletune.env.DistributedEnv` of rank `rank` of a job of `world` ranks, as
    `DistributedEnv.from_environ` would report it on one node: launcher "none" for one rank and
    "torchrun" for more (unless given), `local_world` ranks on the node (default: all of them),
    `gpus` CUDA devices visible (0: a CPU job) of `memory_gib` GiB each, bfloat16 supported where
    there are GPUs (unless `bf16` says otherwise)."""
    from scaletune.env import DistributedEnv

    return DistributedEnv(
        launcher or ("none" if world == 1 else "torchrun"),  # type: ignore[arg-type]
        rank=rank,
        local_rank=rank % (local_world or world),
        world_size=world,
        local_world_size=local_world or world,
        cuda_available=gpus > 0,
        cuda_device_count=gpus,
        device_memory_bytes=None if memory_gib is None else int(memory_gib * 2**30),
        bf16_supported=gpus > 0 if bf16 is None else bf16,
    )


def subprocess_env(base: Mapping[str, str] | None = None, /, **extra: str | None) -> dict[str, str]:
    """This process's environment (or `base`) for a child that runs scaletune: offline, DeepSpeed on its CPU
    accelerator where no CUDA GPU is visible (on a GPU, DeepSpeed must find CUDA), the checkout
    (src/ and the repository, for `tests.*`) first on PYTHONPATH (tests/instrument before them while
    tests/instrument), no launcher variables inherited; `extra` set last (a value of
    None removes the variable)."""
    import torch

    # The zygote is named by the callers that want their child delegated (run_cli's forks, run_torchrun),
    # not inherited from a worker whose own children are delegated (:func:`worker_children_through_zygote`).
    skip = {*LAUNCHER_VARS, "SCALETUNE_TEST_ZYGOTE"}
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in skip}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
    # tests/instrument/sitecustomize.py: each child logs its CPU at exit while SCALETUNE_PROCESS_LOG is
    # set, and hands itself to a zygote where SCALETUNE_TEST_ZYGOTE names one (tests/forked_cli.py delegate)
    paths = [str(REPO_ROOT / "tests" / "instrument"), str(REPO_ROOT / "src"), str(REPO_ROOT)]
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    for name, value in extra.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_torchrun(
    target: str | Path,
    *args: str | Path,
    nproc: int = 2,
    module: bool = False,
    env: dict[str, str] | None = None,
    unset: tuple[str, ...] = (),
    cwd: Path | None = None,
    timeout: int = 300,
) -> subprocess.CompletedProcess:
    """Start `nproc` ranks of the script `target` (or, `module=True`, of `python -m target`) with
    `args` under torchrun on this machine and wait for them: `--standalone` (a c10d rendezvous on
    a free port of localhost, so tests never collide on 29500), the environment of
    :func:`subprocess_env` with one OpenMP thread a rank (CPU: the ranks pick gloo) less the
    variables named in `unset` (this process's), plus `env`. Returns the finished process,
    its output captured as text; raises subprocess.TimeoutExpired after `timeout` seconds."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
    argv += ["--nproc-per-node", str(nproc), *(["-m"] if module else []), str(target), *map(str, args)]
    child_env = _rank_env()
    for name in unset:
        child_env.pop(name, None)
    child_env.update(env or {})
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=child_env, cwd=cwd or REPO_ROOT)


def run_python(
    script: Path, *args: str | Path, timeout: int = 300, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`python SCRIPT args` as one process, as :func:`run_torchrun` starts each rank (its environment,
    one OpenMP thread, a fork of the zygote where it can be; `env` set over it), for a driver's
    single-process control. Returns the finished process, its output captured as text; raises
    subprocess.TimeoutExpired."""
    argv = [sys.executable, str(script), *map(str, args)]
    child_env = {**_rank_env(), **(env or {})}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=child_env, cwd=cwd or REPO_ROOT)


def worker_children_through_zygote() -> None:
    """The processes this test worker starts itself, not through :func:`run_cli` or
    :func:`run_torchrun`: an in-process service's jobs, their config checks and tasks
    (scaletune/serve/jobs: `python -m scaletune ...` in the service's environment). They start as
    those helpers' children do (:func:`subprocess_env`: logged, tests/instrument first on
    PYTHONPATH) and hand themselves to this worker's zygote (tests/forked_cli.py delegate; a job's
    own HF_HOME is re-pointed there, its refusals are a fresh start), where each imported torch and
    transformers anew (~6 CPU-s: 44 jobs in the serve tier at 3a4883a). Idempotent; nothing where
    SCALETUNE_TEST_FORK=0."""
    if os.environ.get("SCALETUNE_TEST_FORK") == "0" or os.environ.get("SCALETUNE_TEST_ZYGOTE"):
        return
    env = subprocess_env()
    for name in ("PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM", "DS_ACCELERATOR"):
        if name in env:
            os.environ[name] = env[name]
    os.environ["SCALETUNE_TEST_ZYGOTE"] = _zygote().socket_path


def _rank_env() -> dict[str, str]:
    """A rank's environment (:func:`run_torchrun`'s and :func:`run_python`'s): :func:`subprocess_env`
    with one OpenMP thread, and the zygote named so the process and its children are forks of it
    where they can be (tests/forked_cli.py delegate)."""
    child_env = subprocess_env(OMP_NUM_THREADS="1")
    if os.environ.get("SCALETUNE_TEST_FORK") != "0":
        child_env["SCALETUNE_TEST_ZYGOTE"] = _zygote().socket_path
    return child_env


SEQUENTIAL_RUNS = REPO_ROOT / "tests" / "distributed" / "sequential_runs.py"


def train_sequentially(jobs: dict[str, list[str]], folder: Path, *, nproc: int, timeout: int = 1800) -> dict[str, str]:
    """Each `scaletune` command line of `jobs` (name -> argv after `scaletune`), one after another,
    in the ranks of one `torchrun --nproc-per-node nproc` (tests/distributed/sequential_runs.py:
    torch and transformers imported once for them all). Returns name -> rank 0's output of that job.

    Raises AssertionError naming the job that failed, with the end of its output."""
    folder.mkdir(parents=True, exist_ok=True)
    logs = {name: folder / f"{name}.log" for name in jobs}
    spec = [{"argv": [str(a) for a in argv], "log": str(logs[name])} for name, argv in jobs.items()]
    (folder / "jobs.json").write_text(json.dumps(spec, indent=1))
    proc = run_torchrun(SEQUENTIAL_RUNS, folder / "jobs.json", nproc=nproc, timeout=timeout)
    for name, log in logs.items():
        status = log.with_name(f"{log.name}.exit")
        said = log.read_text() if log.exists() else ""
        assert status.exists() and status.read_text() == "0", (
            f"{name} ({' '.join(jobs[name])}) did not finish (torchrun exit {proc.returncode}):\n"
            f"{said[-4000:]}\n{proc.stderr[-3000:]}"
        )
    return {name: log.read_text() for name, log in logs.items()}


def train_batch(
    configs: dict[str, dict], folder: Path, *, timeout: int = 300
) -> dict[str, subprocess.CompletedProcess]:
    """`scaletune train` of each config (name -> a :func:`make_config` dict), those of one world size
    (`distributed.num_processes`) one after another in the ranks of one torchrun
    (:func:`train_sequentially`). Returns name -> a record of the run as :func:`train` returns it:
    returncode 0 and rank 0's output as stderr (a run that fails raises AssertionError). A
    torchrun may take `timeout` seconds a job (a tiny run takes 20-60 s on two busy cores)."""
    folder.mkdir(parents=True, exist_ok=True)
    by_world: dict[int, dict[str, list[str]]] = {}
    for name, cfg in configs.items():
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        by_world.setdefault(cfg.get("distributed", {}).get("num_processes", 1), {})[name] = ["train", str(path)]
    said: dict[str, str] = {}
    for world, jobs in sorted(by_world.items()):
        said |= train_sequentially(jobs, folder / f"world-{world}", nproc=world, timeout=timeout * len(jobs))
    return {
        name: subprocess.CompletedProcess(["scaletune", "train", str(folder / f"{name}.yaml")], 0, "", said[name])
        for name in configs
    }


def finish_driver(out: Path, results: dict) -> None:
    """The end of a driver that runs under torchrun (tests/distributed/test_*_parallel.py): rank 0
    writes `results` to `out` as JSON, then every rank leaves the process group together. (A rank
    tearing gloo down while another was still in the group aborted once, "terminate called without
    an active exception", after the results were written, on a busy 2-core machine.)"""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


# The verbs that import torch (most of them transformers too): run_cli forks them from the zygote.
FORKED_VERBS = frozenset(
    {"train", "init-model", "export", "plan", "doctor", "chat", "generate", "eval", "launch", "slurm"}
)


def run_cli(
    args: list[str],
    *,
    timeout: int = 600,
    env: dict | None = None,
    cwd: Path | None = None,
    input: str | None = None,
    cores: set[int] | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """`python -m scaletune ARGS` with the test environment (offline, DeepSpeed on the CPU); `input`
    is its standard input (none: an empty one); `cores` its affinity mask (`taskset`'s), and then
    no OMP_NUM_THREADS (the test worker's share, tests/conftest.py): the process sizes its threads
    from those cores.

    A verb that imports torch (:data:`FORKED_VERBS`) runs in a fork of this worker's CLI zygote
    (tests/forked_cli.py: torch and transformers already imported, 8-10 CPU-s less a call) unless
    `fresh` is set, `cores` is, its environment changes a variable read at import time, or
    SCALETUNE_TEST_FORK=0: then, as every other verb (`--help` costs 0.4 CPU-s, the zygote 12 once),
    in a new process. The processes a forked verb starts in turn (the torchrun a plain `train` of
    several processes re-executes into, its ranks) are handed to the zygote where they can be
    (tests/forked_cli.py delegate); with `fresh`, `cores` or SCALETUNE_TEST_FORK=0 they start as
    users' do."""
    if cores:
        env = {"OMP_NUM_THREADS": None, **(env or {})}
    child_env = subprocess_env(**(env or {}))
    forked = args[:1] and args[0] in FORKED_VERBS and "--help" not in args
    zygote = _zygote() if forked and not (fresh or cores or os.environ.get("SCALETUNE_TEST_FORK") == "0") else None
    if zygote is not None:
        # The torchrun a plain `train` of several processes re-executes into, and that torchrun's
        # ranks, are forks of the zygote too where their environment allows (tests/forked_cli.py
        # delegate), even where this command itself must start fresh.
        child_env["SCALETUNE_TEST_ZYGOTE"] = zygote.socket_path
        if zygote.can_run(child_env):
            return zygote.run(args, env=child_env, cwd=cwd or REPO_ROOT, input=input or "", timeout=timeout)
    return subprocess.run(
        [sys.executable, "-m", "scaletune", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env,
        cwd=cwd or REPO_ROOT,
        input=input if input is not None else "",
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
    )


# The environment this session's tests start from, recorded once collection is done
# (tests/conftest.py pytest_collection_finish): the CLI zygote's, whatever the test that first asks
# for one has monkeypatched (a zygote started inside a test that set MODAL_CONFIG_PATH would
# differ from every later call, which would then each start fresh).
SESSION_ENVIRON: dict[str, str] = {}


@functools.cache
def _zygote():
    """This worker's CLI zygote (tests/forked_cli.py), started on first use, closed at exit."""
    from tests.forked_cli import ForkServer

    server = ForkServer(subprocess_env(SESSION_ENVIRON or None, PYTEST_CURRENT_TEST=None), REPO_ROOT)
    atexit.register(server.close)
    return server


def train(
    cfg: dict,
    tmp_path: Path,
    *,
    name: str = "config.yaml",
    expect_ok: bool = True,
    launcher: str = "scaletune",
    **kw,
) -> subprocess.CompletedProcess:
    """`scaletune train` of `cfg` (written to `tmp_path / name`) as a user starts it: plainly
    (launcher="scaletune": more than one process re-executes under torchrun), or for a config of
    more than one process with launcher="torchrun", `torchrun --nproc-per-node N -m scaletune
    train` (the ranks' work is the same; what it skips is the re-executing parent's preflight,
    about 6 CPU-s a run)."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    nproc = cfg.get("distributed", {}).get("num_processes", 1)
    if launcher == "torchrun" and nproc > 1:
        proc = run_torchrun("scaletune", "train", path, nproc=nproc, module=True, timeout=kw.pop("timeout", 600), **kw)
    else:
        assert launcher in ("scaletune", "torchrun"), launcher
        proc = run_cli(["train", str(path)], **kw)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(
            f"scaletune train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def metrics(run_dir: Path | str) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


# Gradient norms of a full fine-tune agree across engines only to a few 1e-4: the float32 norm of
# the head's gradient is itself accurate only to a few 1e-4 on the CPU (OLMo-2's 100,352 x 64 head,
# step 1 of the base config: 1.032107 in float32, 1.032413 in float64), and the engines sum it
# differently (single and DDP: the whole tensor, reported 1.903663; FSDP: per shard, 1.903743;
# DeepSpeed ZeRO: 1.903829 = the float64 total). With the tests' 27,136-row head (tiny_model_dir)
# the single-process norm is 1.3e-4 off ZeRO's at step 1 and 7.2e-4 by step 8 (FSDP: 6.7e-5, 3.7e-4),
# while the losses, and every parameter's gradient, agree to 2e-7.
GRAD_REL = 1e-3


def steps(run_dir: Path | str) -> list[dict]:
    """The metrics.jsonl lines of optimizer steps (not eval lines)."""
    return [m for m in metrics(run_dir) if "loss" in m]


def losses(run_dir: Path | str) -> list[float]:
    return [m["loss"] for m in steps(run_dir)]


def grad_norms(run_dir: Path | str) -> list[float]:
    return [m["grad_norm"] for m in steps(run_dir)]


def assert_same_steps(
    run_dir: Path | str, ref_dir: Path | str, rel: float, what: str, *, first: int = 0, grad_rel: float | None = None
) -> None:
    """Every logged step of `run_dir` has the loss and the gradient norm of `ref_dir`'s step of
    the same number (`ref_dir`'s steps from index `first` on): within `rel` (`grad_rel` for the
    norm, default `rel`), relative. The norm is taken before clipping, so it sees a gradient that
    clipping would hide from the loss."""
    got, ref = steps(run_dir), steps(ref_dir)[first:]
    assert [m["step"] for m in got] == [m["step"] for m in ref], f"{what}: steps {[m['step'] for m in got]}"
    assert_close([m["loss"] for m in got], [m["loss"] for m in ref], rel, f"{what}: loss")
    assert_close([m["grad_norm"] for m in got], [m["grad_norm"] for m in ref], grad_rel or rel, f"{what}: grad_norm")


def logits(model_dir: Path, adapter: bool = False):
    """Logits of a saved model (or of a LoRA adapter over its base) on a fixed batch of 2 x 16 ids."""
    import torch

    if adapter:
        from peft import AutoPeftModelForCausalLM as Auto
    else:
        from transformers import AutoModelForCausalLM as Auto
    model = Auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(3, 35).reshape(2, 16)).logits


def assert_same_logits(a, b, what: str) -> None:
    import torch

    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), f"{what}: max logit difference {(a - b).abs().max():.2e}"


def assert_close(actual: list[float], expected: list[float], rel: float, what: str) -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} steps vs {len(expected)}"
    worst = max(abs(a - e) / max(abs(e), 1e-12) for a, e in zip(actual, expected))
    assert worst <= rel, (
        f"{what}: worst relative difference {worst:.2e} > {rel:.0e}\n actual   {actual}\n expected {expected}"
    )


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    """Poll `predicate()` every `interval` seconds until it returns something truthy, and return
    that; fail the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def run_bench(tmp_path: Path, preset: str, *args: str, timeout: int) -> tuple[dict, str]:
    """Run benchmarks/bench.py with `--preset PRESET ARGS`, its models cached under tmp_path;
    returns (the JSON report it wrote, its stdout), failing the test with its stderr when it exits
    non-zero."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "bench.py"), "--preset", preset, *args]
    cmd += ["--cache", str(tmp_path / "models"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def digit_chats(out: Path, n_train: int, n_eval: int) -> dict[str, Path]:
    """scikit-learn's digits as image files and chat records under `out`, as the example renders them
    (examples/vlm-digits/render_digits.py): {"train": JSONL, "eval": JSONL}."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_digits", REPO_ROOT / "examples/vlm-digits/render_digits.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.render(out, n_train, n_eval)


def with_mlp_outputs_swapped(folder: Path, out: Path) -> Path:
    """A copy of the one-file model folder `folder` at `out` with layer 0's and layer 1's MLP output
    weights swapped: every tensor present, every shape right (a loader's mistake), the model wrong.
    The control that an export's check can fail."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in folder.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(folder / "model.safetensors"))
    a, b = (f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 1))
    weights[a], weights[b] = weights[b], weights[a]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def save_random_llama(out: Path, tokenizer_file: Path, *, seed: int = 0, **config: Any) -> Path:
    """A `LlamaConfig(**config)` model with random float32 weights (drawn after
    `torch.manual_seed(seed)`) saved to `out` with a tokenizer over `tokenizer_file`, whose
    `model_max_length` is the config's `max_position_embeddings`: a folder `from_pretrained` loads."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from scaletune.models import tokenizer_from_file

    llama = LlamaConfig(**config)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(llama, dtype=torch.float32).save_pretrained(out)
    tokenizer_from_file(tokenizer_file, model_max_length=llama.max_position_embeddings).save_pretrained(out)
    return out


def save_teacher_llama(out: Path, student: Path, *, seed: int = 7) -> Path:
    """A distillation teacher for the tiny `student` folder: a random Llama larger than the tiny
    presets (hidden 128, 4 layers, untied head) with the tests' tokenizer and the student's
    `vocab_size` (:func:`save_random_llama`)."""
    vocab = json.loads((student / "config.json").read_text())["vocab_size"]
    return save_random_llama(
        out,
        SMALL_TOKENIZER,
        seed=seed,
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def modules_after(args: list[str], *, returncode: int = 0) -> set[str]:
    """The modules `scaletune ARGS` has imported by the time it exits (with `returncode`), in a fresh
    process (a name set to None in `sys.modules`, which marks a package absent, is not imported)."""
    code = "import sys\nfrom scaletune.cli import main\ntry:\n    main(sys.argv[1:])\nfinally:\n    print('MODULES', *[k for k, v in sys.modules.items() if v is not None])\n"
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=subprocess_env(),
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == returncode, proc.stderr[-3000:]
    return set(proc.stdout.splitlines()[-1].split()[1:])


def assert_refused(cfg: dict, tmp_path: Path) -> str:
    """`scaletune train` of `cfg` refused as bad input: exit 2, no traceback, no run directory
    written (tmp_path/run); returns stderr."""
    proc = train(cfg, tmp_path, expect_ok=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists(), "nothing may be written before validation passes"
    return proc.stderr


def assert_located(err: str, config: Path, line_text: str, message: str) -> None:
    """`message` is in `err` prefixed by `config`'s file:line of the YAML line `line_text`."""
    line = config.read_text().splitlines().index(line_text) + 1
    assert f"{config}:{line}: {message}" in err, err


class LoopbackHub:
    """The hub on loopback, as huggingface_hub 2.4 calls it. Reading: the file routes (`HEAD`/`GET
    /{repo}/resolve/{revision}/{file}`) for `repos` ({repo id: (files, commit)}); `hostile` repos
    answer each file's ETag as a path up the cache. Uploading (`HfApi.create_repo`,
    `upload_folder`): `POST /api/repos/create`, `/api/models/{repo}/preupload/{rev}` (every file
    answered "regular", so its bytes come inline, base64, in the commit: no LFS or Xet storage),
    `/api/validate-yaml` (a README's metadata: no errors) and `/api/models/{repo}/commit/{rev}`; a
    commit's files join `repos` (readable back). Records
    (method, path, Authorization) of every request; `private` the repos created and whether
    private. What a real Hub does beyond this (LFS and Xet storage, permissions) stays unverified."""

    def __init__(
        self, repos: dict[str, tuple[dict[str, bytes], str]] | None = None, hostile: set[str] = frozenset()
    ) -> None:
        self.seen: list[tuple[str, str, str | None]] = []
        self.repos = repos = {} if repos is None else repos
        self.private: dict[str, bool] = {}
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def answer(self, body: bool) -> None:
                hub.seen.append((self.command, self.path, self.headers.get("Authorization")))
                repo, _, rest = self.path.split("?")[0].strip("/").partition("/resolve/")
                files, commit = repos.get(repo, ({}, ""))
                name = rest.partition("/")[2]
                if name not in files:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.end_headers()
                    return
                data = files[name]
                etag = f"../../../../planted-{name}" if repo in hostile else hashlib.sha256(data).hexdigest()
                self.send_response(200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{etag}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def do_HEAD(self) -> None:
                self.answer(False)

            def do_GET(self) -> None:
                self.answer(True)

            def do_POST(self) -> None:
                hub.seen.append((self.command, self.path, self.headers.get("Authorization")))
                data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    req = json.loads(data)
                    repo = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
                    hub.private[repo] = bool(req.get("private")) or req.get("visibility") == "private"
                    repos.setdefault(repo, ({}, ""))
                    return self.json({"url": f"{hub.url}/{repo}", "name": repo})
                if path == "/api/validate-yaml":  # a README.md's metadata, checked before its commit
                    return self.json({"errors": [], "warnings": []})
                m = re.fullmatch(r"/api/models/(?P<repo>[^/]+/[^/]+)/(?P<route>preupload|commit)/[^/]+", path)
                if m is None:
                    return self.send_error(404)
                if m["route"] == "preupload":
                    names = [f["path"] for f in json.loads(data)["files"]]
                    return self.json(
                        {"files": [{"path": n, "uploadMode": "regular", "shouldIgnore": False} for n in names]}
                    )
                lines = [json.loads(line) for line in data.splitlines() if line.strip()]
                added = {
                    x["value"]["path"]: base64.b64decode(x["value"]["content"]) for x in lines if x["key"] == "file"
                }
                oid = hashlib.sha1(data).hexdigest()
                files, _ = repos.get(m["repo"], ({}, ""))
                repos[m["repo"]] = ({**files, **added}, oid)
                self.json(
                    {"commitUrl": f"{hub.url}/{m['repo']}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}
                )

            def json(self, value: dict) -> None:
                out = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def asked_for(self, repo: str) -> list[str]:
        return [path for _, path, _ in self.seen if path.startswith(f"/{repo}/")]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
