"""`scaletune train CONFIG [overrides]` as this process: the restricted loader, the environment,
the preflight, the re-exec under torchrun when no launcher started this one, then the loop."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from scaletune.config import read_config
from scaletune.env import CpuBudget, DistributedEnv, configure_logging, cpu_budget, print0, tune_host_allocator
from scaletune.resolve import RunSpec
from scaletune.run.preflight import check_data, predicted_memory, prepare
from scaletune.run.reexec import reexec_under_torchrun

if TYPE_CHECKING:
    from scaletune.config import LoadedConfig


def run_from_cli(config_path: Path | str, overrides: list[str], *, check_only: bool = False) -> Path | None:
    """`scaletune train CONFIG [overrides]` as this process (a rank, or the parent that re-executes);
    with `check_only`, every check that can run without training (data tokenised), then stop.
    Returns the run directory (None after a check)."""
    loaded = read_config(config_path, overrides)
    if loaded.problems and not _gpu_device_files():
        # A config that does not validate is answered before torch and transformers are imported
        # (about 4 s of CPU): its problems with the model's and the data's that need neither. Only
        # where no GPU can be present: the rules that depend on the GPUs (`num_processes: auto`, the
        # precision) would be checked against a machine without any, and name problems it lacks.
        light = DistributedEnv.from_environ(probe_cuda=False)
        configure_logging(light.rank)
        prepare(loaded, light)
        raise AssertionError("prepare returned a run for a config with problems")
    env = DistributedEnv.from_environ()
    configure_logging(env.rank)  # an entry point: `scaletune train` as a rank, or called in-process
    from scaletune.safe_load import enforce

    # Every torch.load of this process and its ranks through the restricted unpickler. DeepSpeed's
    # classes join the allow-list only for a run DeepSpeed loads files in (below): importing
    # DeepSpeed for them costs 0.3 s of CPU in every rank of every other run.
    enforce(deepspeed=False)
    budget = None
    if env.device.type == "cpu":
        tune_host_allocator()  # before the model and data are allocated
        budget = _size_cpu_threads(env)
    _set_unused_bitsandbytes_aside(loaded)
    spec = prepare(loaded, env)
    if spec.strategy == "deepspeed" and not check_only:
        enforce(deepspeed=True)
    if check_only or (not env.launched and spec.world_size > 1):
        check_data(spec)  # before the ranks start, so bad data ends here, once, with exit 2
    if check_only:
        print0(f"[scaletune] {config_path}: every check passed; {spec.batch.describe()}")
        return None
    if not env.launched and spec.world_size > 1:
        reexec_under_torchrun(spec, config_path, overrides)
    if budget is not None:
        print0(f"[scaletune] CPU threads: {budget.describe()}")
    return train(spec)


def _gpu_device_files() -> bool:
    """Whether this machine shows an NVIDIA or AMD GPU's device files (`/dev/nvidia0`, `/dev/kfd`),
    read without importing torch."""
    dev = Path("/dev")
    return any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists()


def _size_cpu_threads(env: DistributedEnv) -> CpuBudget:
    """Size torch's intra-op pool for a CPU rank from the cores it may use (:class:`CpuBudget`);
    torch's default counts the machine's cores, whatever the affinity mask, the container's quota
    or the other ranks on the node leave to this one."""
    import torch

    budget = cpu_budget(env.local_world_size)
    torch.set_num_threads(budget.threads)
    return budget


def train(spec: RunSpec) -> Path:
    """Train a prepared run as this rank; returns the run directory."""
    from scaletune.run.rundir import opened
    from scaletune.trainer import Trainer

    if spec.env.restart_count > 0 and spec.config.training.resume == "auto":
        attempt = spec.env.restart_count + 1
        print0(f"[scaletune] restarted by torchrun: resuming from the latest checkpoint (attempt {attempt})")
    predicted = predicted_memory(spec) if spec.env.is_main else None
    return Trainer(spec, predicted_memory=predicted, open_run_dir=opened).fit()


def _set_unused_bitsandbytes_aside(loaded: LoadedConfig) -> None:
    """Treat bitsandbytes as not installed in a run that quantizes nothing.

    peft imports bitsandbytes whenever it is installed (peft/helpers.py, peft 0.21), and
    bitsandbytes wraps its CPU ops in `torch.compile` at import, which imports torch._dynamo and
    inductor: about 2 s of CPU at the start of every rank. Without `model.quantization` no code of
    the run uses it, so this process marks it absent (`sys.modules[name] = None`: `import` raises
    ImportError and `importlib.util.find_spec` returns None, which is how peft and transformers ask),
    as on a machine without the `gpu` extra."""
    config = loaded.config or loaded.best_effort
    if config is not None and config.model.quantization is None and "bitsandbytes" not in sys.modules:
        sys.modules["bitsandbytes"] = None
